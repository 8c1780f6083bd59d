"""The stall deadline: a daemon that stops sending without ending the stream makes the
loader reconnect at its cursor, and give up with a clear error, never hang (a fake
daemon in process; a ``feeder serve`` stopped with SIGSTOP in the slow test); a
request the daemon refuses ends the stream at once; a transport this process cannot
use falls back to the next one down; a reopened call asks for the stream's spec moved
to its batch, through the same checks as the first."""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import numpy as np
import pytest

from clients import FeederLoader
from clients.config import LoaderConfig
from clients.failover import Failover
from clients.pool import DaemonPool
from core.errors import ConfigError, InvalidArgument, ServiceUnavailable
from launcher.daemon_process import DaemonProcess
from protocol.batch import BatchMeta, to_message
from protocol.plan import LastBatch, plan_length
from protocol.request import MAX_BATCH_STRIDE, StreamSpec, from_request, to_request
from protocol.stream_plan import StreamWindow
from protos import feeder_pb2, feeder_pb2_grpc
from transport.base import TransportKind

SAMPLES = 24
SIDE = 16  # the smallest side a request may ask for


class StallingFeeder(feeder_pb2_grpc.FeederServicer):
    """Serves ``SAMPLES`` tiny samples of dataset ``fake``; a stream stops sending (and
    keeps the call open) where ``stalls(call_index, cursor)`` says so."""

    def __init__(self, stalls: Callable[[int, int], bool],
                 ends: Callable[[int, int], bool] = lambda c, k: False) -> None:
        self.stalls, self.ends = stalls, ends
        self.calls = 0
        self.requests: list[feeder_pb2.StreamRequest] = []  # as received, in order
        self._lock = threading.Lock()

    def ListDatasets(self, request, context):
        split = feeder_pb2.SplitInfo(name="train", num_samples=SAMPLES)
        info = feeder_pb2.DatasetInfo(name="fake", splits=[split], classes=["a"])
        return feeder_pb2.ListDatasetsResponse(datasets=[info])

    def StreamBatches(self, request, context) -> Iterator[feeder_pb2.Batch]:
        with self._lock:
            call, self.calls = self.calls, self.calls + 1
            self.requests.append(request)
        part = SAMPLES // request.world_size  # rank r's samples, as keys r, r + w, ... would be
        for epoch in range(request.epoch, request.epoch + max(1, request.epochs)):
            cursor = request.start_cursor if epoch == request.epoch else 0
            while cursor + request.batch_size <= part:
                if self.stalls(call, cursor):
                    while context.is_active():  # sends nothing until the client goes away
                        time.sleep(0.05)
                    return
                if self.ends(call, cursor):  # ends the call with OK, batches left in its plan
                    return
                n = request.batch_size
                yield feeder_pb2.Batch(
                    epoch=epoch, cursor=cursor + n, keys=[str(i) for i in range(cursor, cursor + n)],
                    labels=[0] * n, images=bytes(n * SIDE * SIDE * 3), shape=[n, SIDE, SIDE, 3],
                    samples_per_rank=part)
                cursor += n


@pytest.fixture
def fake_daemon() -> Iterator[Callable[[Callable[[int, int], bool]], str]]:
    servers = []

    def start(stalls: Callable[[int, int], bool], ends: Callable[[int, int], bool] = lambda c, k: False) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        feeder_pb2_grpc.add_FeederServicer_to_server(StallingFeeder(stalls, ends), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait(10)


def _loader(address: str, **options) -> FeederLoader:
    base = {"dataset": "fake", "batch_size": 4, "image_size": SIDE, "rank": 0, "world_size": 1,
            "return_keys": True, "normalize": False, "prefetch_batches": 1,
            "stall_timeout_s": 0.5, "reconnect_timeout_s": 5.0}
    return FeederLoader(address=address, **(base | options))


def test_stalled_stream_reopens_at_its_cursor_without_loss_or_repeat(fake_daemon) -> None:
    address = fake_daemon(lambda call, cursor: call == 0 and cursor == 8)
    started = time.monotonic()
    with _loader(address) as loader:
        keys = [k for _, _, batch_keys in loader for k in batch_keys]
        assert loader.reconnects >= 1
    assert keys == [str(i) for i in range(SAMPLES)]
    assert time.monotonic() - started < 10


def test_a_stream_that_ends_before_its_plan_does_is_reopened_at_its_cursor(fake_daemon) -> None:
    # The first call ends with OK at cursor 8 of 24. Before: the loader took that as the
    # end of the epoch and went on to the next, 16 samples short, without a word.
    address = fake_daemon(lambda call, cursor: False, ends=lambda call, cursor: call == 0 and cursor == 8)
    with _loader(address, prefetch_next_epoch=False) as loader:
        keys = [k for _, _, batch_keys in loader for k in batch_keys]
        assert loader.reconnects == 1
    assert keys == [str(i) for i in range(SAMPLES)]


def test_a_reopened_call_asks_for_the_first_calls_spec_moved_to_its_cursor() -> None:
    feeder = StallingFeeder(lambda call, cursor: call == 0 and cursor == 8)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    feeder_pb2_grpc.add_FeederServicer_to_server(feeder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with _loader(f"127.0.0.1:{port}", transport="grpc") as loader:
            keys = [k for _, _, batch_keys in loader for k in batch_keys]
            assert loader.reconnects == 1
    finally:
        server.stop(0).wait(10)
    assert keys == [str(i) for i in range(SAMPLES)]
    first, reopened = feeder.requests[:2]
    spec = from_request(first)
    # Everything the loader asks for is on the spec: the transport, its host, its prefetch.
    assert spec.transport == feeder_pb2.TRANSPORT_GRPC and spec.client_host is not None and spec.client_host.pid
    assert spec.prefetch_batches == 1 and spec.start_cursor == 0
    assert reopened == to_request(dataclasses.replace(spec, start_cursor=8))


def test_a_reopen_the_daemon_would_refuse_is_refused_with_its_message(fake_daemon) -> None:
    spec = StreamSpec("fake", "train", batch_size=4, image_size=SIDE)
    failover = _failover(fake_daemon(lambda call, cursor: False), spec)
    try:
        assert to_request(failover.spec_from(2, 3)) == to_request(
            dataclasses.replace(spec, start_cursor=8, batch_stride=3))
        # A share of a pool wider than a stride may be: the request the daemon would get.
        request = to_request(spec)
        request.start_cursor, request.batch_stride = 8, MAX_BATCH_STRIDE + 1
        with pytest.raises(InvalidArgument) as daemon_says:
            from_request(request)
        with pytest.raises(ConfigError) as refused:
            failover.spec_from(2, MAX_BATCH_STRIDE + 1)
        assert str(refused.value) == str(daemon_says.value) and str(refused.value).startswith("batch_stride: ")
    finally:
        failover.close()


@pytest.mark.slow
def test_gives_up_naming_daemon_dataset_split_rank_and_cursor(fake_daemon) -> None:
    address = fake_daemon(lambda call, cursor: call > 0 or cursor == 8)
    started = time.monotonic()
    with _loader(address, reconnect_timeout_s=1.0, rank=1, world_size=2) as loader:
        with pytest.raises(ServiceUnavailable) as raised:
            for _ in loader:
                pass
        assert loader.reconnects >= 1
    message = str(raised.value)
    for part in (address, "'fake'", "'train'", "rank 1 of 2", "cursor 8", "no batch for"):
        assert part in message, message
    assert time.monotonic() - started < 10


def _failover(address: str, spec: StreamSpec, open_stream=None, **options) -> Failover:
    """A failover over the one daemon at ``address`` (``open_stream`` in place of its calls)."""
    config = LoaderConfig(address=address, dataset=spec.dataset, **options)
    pool = DaemonPool(config, [address])
    part = plan_length(pool.describe(5.0).num_samples, spec.world_size, spec.last_batch)
    if open_stream is not None:
        pool.members[0].connection.stream_batches = open_stream
    window = StreamWindow(spec.epoch, spec.epochs, spec.start_cursor, spec.batch_size, spec.last_batch, part, part)
    failover = Failover(pool, spec, window, config, pin=None)
    failover.close = lambda close=failover.close: (close(), pool.close())  # type: ignore[method-assign]
    return failover


def test_a_refused_request_ends_the_stream_at_once_without_retrying(daemon) -> None:
    # Over the test daemon's --max-batch-size of 64: a loader would refuse it itself.
    spec = StreamSpec("sample", "train", batch_size=1000, image_size=32, last_batch=LastBatch.PAD)
    failover = _failover(daemon, spec, reconnect_timeout_s=600, stall_timeout_s=600)
    try:
        with pytest.raises(InvalidArgument, match=r"batch_size: 1000 is not in 1\.\.64"):
            failover.get()
        assert failover.reconnects == 1  # the one call, left
    finally:
        failover.close()


def test_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        _loader("127.0.0.1:9", stall_timeout_s=0)


class _DeafCall:
    """A call that never sends and ignores cancel (a stuck transport)."""

    def __init__(self, released: threading.Event) -> None:
        self._released = released

    def __iter__(self) -> Iterator[feeder_pb2.Batch]:
        self._released.wait()
        return iter(())

    def cancel(self) -> None:
        pass


@pytest.mark.slow
def test_get_gives_up_even_when_the_stream_ignores_cancel(fake_daemon) -> None:
    released = threading.Event()
    address = fake_daemon(lambda call, cursor: False)
    spec = StreamSpec("fake", "train", batch_size=4, image_size=SIDE)
    failover = _failover(address, spec, lambda _: _DeafCall(released), reconnect_timeout_s=0.5, stall_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(ServiceUnavailable, match=address):
            failover.get()
        assert time.monotonic() - started < 8
    finally:
        released.set()
        failover.close()


@pytest.mark.slow
def test_stopped_daemon_process_is_a_clear_error_not_a_hang(shards) -> None:
    with DaemonProcess({"sample": shards}, options=("--device", "cpu", "--threads", "1")) as daemon:
        loader = FeederLoader(address=daemon.address, dataset="sample", batch_size=2, image_size=32,
                              rank=0, world_size=1, prefetch_batches=1, stall_timeout_s=1.0,
                              reconnect_timeout_s=2.0)
        batches = iter(loader)
        next(batches)
        os.kill(daemon.pid, signal.SIGSTOP)  # stops sending, keeps its connections open
        started = time.monotonic()
        try:
            with pytest.raises(ServiceUnavailable, match=daemon.address):
                for _ in batches:
                    pass
            assert time.monotonic() - started < 10
            assert loader.reconnects >= 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            loader.close()


GPU = "GPU-5f3a0c1e-aaaa-4bbb-8ccc-0123456789ab"  # a GPU no process here sees


def _fallback_batch(request: feeder_pb2.StreamRequest, cursor: int, where: str) -> feeder_pb2.Batch:
    """A batch at ``cursor`` whose pixels are in a CUDA IPC ring this process cannot
    open, in a shared-memory segment it cannot map, or inline."""
    n, side = min(request.batch_size, SAMPLES - cursor), request.image_size
    meta = BatchMeta(epoch=request.epoch, cursor=cursor + n, samples_per_rank=SAMPLES,
                     keys=[str(i) for i in range(cursor, cursor + n)], labels=np.zeros(n, dtype=np.int64),
                     padding=np.zeros(n, dtype=bool))
    message = to_message(meta, (n, side, side, 3))
    slot = feeder_pb2.SlotRef(stream_id="feeder-1-ab-1", index=0, generation=1)
    if where == "cuda":
        message.cuda.CopyFrom(feeder_pb2.CudaSlot(slot=slot, ring=feeder_pb2.CudaRing(device_uuid=GPU)))
    elif where == "shm":
        message.shm.CopyFrom(feeder_pb2.ShmSlot(slot=slot, segment="feeder-1-ab-1", segment_bytes=n * side * side * 3))
    else:
        message.images = bytes(n * side * side * 3)
    return message


class FallbackFeeder(StallingFeeder):
    """Sends a stream's first batch over the transport asked for (CUDA IPC for auto;
    for shm, ``shm_as``), all of them inline once asked for gRPC; records what each
    request asked for."""

    def __init__(self, shm_as: str = "shm") -> None:
        super().__init__(lambda call, cursor: False)
        self.asked: list[TransportKind] = []
        self.shm_as = shm_as

    def StreamBatches(self, request, context) -> Iterator[feeder_pb2.Batch]:
        kind = TransportKind(request.transport)
        self.asked.append(kind)
        if kind != TransportKind.GRPC:
            yield _fallback_batch(request, request.start_cursor, self.shm_as if kind == TransportKind.SHM else "cuda")
            while context.is_active():  # the client cancels once it cannot open the batch
                time.sleep(0.01)
            return
        for cursor in range(request.start_cursor, SAMPLES, request.batch_size):
            yield _fallback_batch(request, cursor, "inline")


@pytest.mark.parametrize("shm_as", ["shm", "cuda"])  # cuda: a daemon that still answers shm with CUDA IPC
def test_transports_this_process_cannot_use_fall_back_to_the_next_with_one_warning_each(caplog, shm_as) -> None:
    feeder = FallbackFeeder(shm_as)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
    feeder_pb2_grpc.add_FeederServicer_to_server(feeder, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with caplog.at_level(logging.WARNING, logger="clients.failover"), \
                _loader(f"127.0.0.1:{port}", transport="cuda_ipc", prefetch_batches=2) as loader:
            first = [k for _, _, keys in loader for k in keys]
            loader.set_image_size(2 * SIDE)  # a new stream: it asks for what worked
            second = [k for _, _, keys in loader for k in keys]
            assert loader.transport == "grpc"
    finally:
        server.stop(0).wait(10)
    assert first == second == [str(i) for i in range(SAMPLES)]
    assert feeder.asked == [TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.GRPC, TransportKind.GRPC]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert "CUDA IPC unusable here" in warnings[0] and "batches come over shared memory" in warnings[0]
    failed_second = "shared memory" if shm_as == "shm" else "CUDA IPC"
    assert f"{failed_second} unusable here" in warnings[1] and "batches come over gRPC" in warnings[1]
