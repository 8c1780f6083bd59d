"""The client's entry to the transports: one :class:`StreamReceiver` per stream
takes whatever the daemon sent (pixels inline, a shared-memory slot, a CUDA IPC
slot) and gives a tensor; one :class:`SlotReleaser` per connection hands slots back
in batched ``ReleaseSlots`` calls (CUDA IPC slots, and shared-memory slots released
after a CUDA event; other shared-memory slots go back through their release words).
The loader sees only ``ReceivedBatch``.

Usage in the loader::

    releaser = SlotReleaser(stub.ReleaseSlots)
    receiver = StreamReceiver(releaser)
    request.transport = feeder_pb2.TRANSPORT_AUTO
    request.client_host.CopyFrom(HostIdentity.of_this_process().client_host(gpu_uuid).to_message())
    call = channel.unary_stream(STREAM_BATCHES, request.SerializeToString, None)
    for data in call(request):
        batch = receiver.receive(parse_batch(data))
        ...
    receiver.close(); releaser.close()
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import grpc
import torch

from protos import feeder_pb2
from transport.base import BatchReceiver, ReceivedBatch, TransportKind, WireBatch
from transport.grpc_payload import InlineReceiver
from transport.shm import ShmReceiver

__all__ = ["STREAM_BATCHES", "SlotReleaser", "StreamReceiver"]

_log = logging.getLogger(__name__)
STREAM_BATCHES = "/feeder.v1.Feeder/StreamBatches"  # method path for a raw stub


class SlotReleaser:
    """A ``ReleaseSink``: queues slots from any thread (finalizers included) and
    sends them from one thread, everything queued so far in one call, so release
    RPCs never outnumber batches and usually cost less than one each.

    Args:
        send: The ``ReleaseSlots`` stub method.
        timeout_s: Deadline of one call.
    """

    def __init__(self, send: Callable[..., object], timeout_s: float = 10.0) -> None:
        self._send = send
        self._timeout_s = timeout_s
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # safe from finalizers
        self.calls = 0
        self.released = 0
        self._thread = threading.Thread(target=self._run, name="feeder-release", daemon=True)
        self._thread.start()

    def __call__(self, ref: feeder_pb2.SlotRef, after: torch.cuda.Event | None = None) -> None:
        self._queue.put((ref, after))

    def close(self, timeout_s: float = 5.0) -> None:
        """Sends what is queued, then stops the thread."""
        self._queue.put(None)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        stopping = False
        while not stopping:
            items = [self._queue.get()]
            while not self._queue.empty():
                items.append(self._queue.get())
            stopping = None in items
            pending = [item for item in items if item is not None]
            if pending:
                self._flush(pending)

    def _flush(self, items: list[tuple[feeder_pb2.SlotRef, torch.cuda.Event | None]]) -> None:
        for _, after in items:
            if after is not None:
                after.synchronize()  # the consumer's copy has finished
        request = feeder_pb2.ReleaseRequest(slots=[ref for ref, _ in items])
        try:
            self._send(request, timeout=self._timeout_s)
        except grpc.RpcError as e:
            # The stream (or the daemon) is gone, and its ring with it; or a bug,
            # which the daemon has refused without harm. Neither is the consumer's.
            _log.warning("releasing %d slot(s) failed: %s", len(items), e.code().name)
            return
        self.calls += 1
        self.released += len(items)


class StreamReceiver(BatchReceiver):
    """Receives one stream's batches, whichever transport carries each one.

    Args:
        release: Hands slots back (a :class:`SlotReleaser`).
        shm_dir: The shm directory shared with the daemon.
    """

    def __init__(self, release: Callable[..., None], shm_dir: Path = Path("/dev/shm")) -> None:
        self._inline = InlineReceiver()
        self._shm = ShmReceiver(release, shm_dir)
        self._shm_dir = shm_dir
        self._release = release
        self._cuda: BatchReceiver | None = None
        self.kind: TransportKind | None = None  # of the last batch

    def receive(self, wire: WireBatch) -> ReceivedBatch:
        where = wire.message.WhichOneof("pixels")
        if where == "cuda":
            self.kind = TransportKind.CUDA_IPC
            return self._cuda_receiver().receive(wire)
        if where == "shm":
            self.kind = TransportKind.SHM
            return self._shm.receive(wire)
        self.kind = TransportKind.GRPC
        return self._inline.receive(wire)

    def close(self) -> None:
        self._shm.close()
        if self._cuda is not None:
            self._cuda.close()

    def _cuda_receiver(self) -> BatchReceiver:
        if self._cuda is None:
            from transport.cuda_ipc import CudaIpcReceiver  # torch.cuda only when used

            self._cuda = CudaIpcReceiver(self._release, self._shm_dir)
        return self._cuda
