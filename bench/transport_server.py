"""The server side of ``bench/transport_only.py``: a process of its own streaming a
pre-made uint8 batch over gRPC, as the daemon would, from a thread-per-call
``grpc.server`` (alone, or behind the daemon's call guard) or a ``grpc.aio`` one
(:func:`serve`); with the paths it serves besides the transports (the path before
the transport package, grpcio's ceiling) and the producer thread ahead of the
handler (:func:`produced`)."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import grpc
import numpy as np

from protos import feeder_pb2
from transport.heap import fit_messages

__all__ = [
    "AIO", "CEILING", "GUARD", "TODAY", "UNLIMITED", "BenchConfig", "encode_before", "premade", "produced", "serve",
]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure.

    Attributes:
        batch_sizes: Images per batch.
        side_px: Image side (pixels), 3 channels, uint8.
        batches: Batches per timed repeat.
        warmup_batches: Batches received and discarded before timing: more than
            ``ring_slots``, so every slot of a stream's new ring has been written once
            (as memcpy's buffers are touched before it is timed).
        repeats: Timed repeats per path and size (the median is reported).
        ring_slots: Shared-memory ring depth.
    """

    batch_sizes: tuple[int, ...] = (64, 256)
    side_px: int = 224
    batches: int = 24
    warmup_batches: int = 6
    repeats: int = 5
    ring_slots: int = 4


_Batch = TypeVar("_Batch")
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
TODAY = "today"  # job_id that selects the current encode path
CEILING = "ceiling"  # job_id: one pre-serialized message, sent again and again
# Path suffixes: the same path from another server (see ``bench/transport_only.py``).
GUARD, AIO = "-guard", "-aio"


def premade(batch_size: int, side_px: int) -> np.ndarray:
    """The batch every path moves: ``batch_size`` random RGB images of ``side_px``
    squared, the same for the same size."""
    rng = np.random.default_rng(batch_size)
    return rng.integers(0, 256, (batch_size, side_px, side_px, 3), dtype=np.uint8)


def encode_before(images: np.ndarray, meta: Any) -> bytes:
    """How the daemon serialized a batch before the transport package: the small
    fields by protobuf, then the pixels joined on (one copy into the message)."""
    from core.wire import BYTES, field_key, varint
    from protocol.batch import to_message

    head = to_message(meta, images.shape).SerializeToString()
    pixels = np.ascontiguousarray(images).data.cast("B")
    return b"".join((head, field_key(5, BYTES), varint(pixels.nbytes), pixels))


_READY_BATCHES = 4  # the daemon's ready queue per stream (``ServerConfig.queue_batches``)


def produced(make: Callable[[], _Batch], count: int) -> Iterator[_Batch]:
    """``count`` results of ``make()``, made on a thread of their own ahead of the
    caller through a bounded queue, as the daemon's producer thread writes batches
    while its gRPC handler sends the ones before."""
    ready: queue.Queue = queue.Queue(_READY_BATCHES)

    def produce() -> None:
        try:
            for _ in range(count):
                ready.put(make())
        except BaseException as e:  # noqa: BLE001 - handed to the consumer
            ready.put(e)

    threading.Thread(target=produce, daemon=True, name="bench-producer").start()
    for _ in range(count):
        item = ready.get()
        if isinstance(item, BaseException):
            raise item
        yield item


def serve(config: BenchConfig, shm_dir: str, ports: Any, stop: Any, server_kind: str) -> None:
    """The daemon side, in its own process: streams the pre-made batch, from a
    thread-per-call ``grpc.server`` (behind the daemon's call guard for ``GUARD``) or
    a ``grpc.aio`` one (``AIO``)."""
    from protocol.batch import BatchMeta
    from protocol.request import ClientHost
    from transport.base import Slot, TransportConfig, TransportKind
    from transport.daemon import TransportHub, TransportRequest

    hub = TransportHub(TransportConfig(shm_dir=Path(shm_dir), ring_slots=config.ring_slots, slot_wait_s=30.0))
    made = {n: premade(n, config.side_px) for n in config.batch_sizes}

    def meta(n: int) -> BatchMeta:
        keys = [f"n{i:08d}_{i}" for i in range(n)]
        return BatchMeta(0, n, 10 * n, keys, np.arange(n, dtype=np.int64), np.zeros(n, dtype=bool))

    def stream(request: feeder_pb2.StreamRequest, context: grpc.ServicerContext) -> Iterator[bytes]:
        images, small = made[request.batch_size], meta(request.batch_size)
        if request.job_id == TODAY:
            # The producer wrote each batch into an array of its own (DALI's
            # ``as_array``); the handler joined it into the message.
            for batch in produced(lambda: images.copy(), request.max_samples):
                yield encode_before(batch, small)
            return
        if request.job_id == CEILING:
            message = encode_before(images, small)
            fit_messages(len(message))  # malloc as the gRPC payload sets it
            for _ in range(request.max_samples):
                yield message
            return
        asked = TransportRequest(TransportKind(request.transport), ClientHost.of_request(request))
        sender = hub.open_sender(asked, images.nbytes)

        def write() -> Slot:
            slot = sender.slot_for(images.shape)
            np.copyto(slot.array, images)  # the producer's one copy
            return slot

        try:
            for slot in produced(write, request.max_samples):
                yield sender.message(slot, small)
        finally:
            hub.close_sender(sender)

    def release(request: feeder_pb2.ReleaseRequest, context: grpc.ServicerContext) -> feeder_pb2.ReleaseResponse:
        return feeder_pb2.ReleaseResponse(released=hub.release(request.slots))

    handlers = {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            stream, request_deserializer=feeder_pb2.StreamRequest.FromString),
        "ReleaseSlots": grpc.unary_unary_rpc_method_handler(
            release, request_deserializer=feeder_pb2.ReleaseRequest.FromString,
            response_serializer=feeder_pb2.ReleaseResponse.SerializeToString),
    }
    generic = grpc.method_handlers_generic_handler("feeder.v1.Feeder", handlers)
    try:
        if server_kind == AIO:
            asyncio.run(_run_aio(generic, ports, stop))
        else:
            _run_sync(generic, ports, stop, guarded=server_kind == GUARD)
    finally:
        hub.close_all()


def _run_sync(generic: grpc.GenericRpcHandler, ports: Any, stop: Any, guarded: bool) -> None:
    """Serve ``generic`` from a thread-per-call server until ``stop`` is set."""
    from feeder.call_guard import CallGuard
    from feeder.metrics import ServerMetrics

    guard = CallGuard(max_waiting_calls=16, timeout_s=10.0, metrics=ServerMetrics()) if guarded else None
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=UNLIMITED,
                         interceptors=[] if guard is None else [guard])
    server.add_generic_rpc_handlers((generic,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    server.start()
    stop.wait()
    server.stop(0)
    if guard is not None:
        guard.close()


async def _run_aio(generic: grpc.GenericRpcHandler, ports: Any, stop: Any) -> None:
    """Serve ``generic`` from a ``grpc.aio`` server until ``stop`` is set; the (sync)
    handlers run in a pool of as many threads as the sync server has."""
    server = grpc.aio.server(migration_thread_pool=futures.ThreadPoolExecutor(max_workers=4), options=UNLIMITED)
    server.add_generic_rpc_handlers((generic,))
    ports.put(server.add_insecure_port("127.0.0.1:0"))
    await server.start()
    await asyncio.get_running_loop().run_in_executor(None, stop.wait)
    await server.stop(0)
