"""CUDA IPC: a ring of device buffers on the client's GPU, allocated by the daemon
and shared once per stream; batches never go through host memory, and neither side
waits on the host for the other's GPU work.

The daemon's pipeline runs on the client's GPU (named by UUID: device indices
differ per process with CUDA_VISIBLE_DEVICES) and writes each batch into a slot of
the ring on the ring's own stream (lowest priority: the training step's kernels go
first), then records the slot's *ready* event there. The message carries the ring's
IPC handles (torch's ``UntypedStorage._share_cuda_``, as
``torch/multiprocessing/reductions.py`` sends a CUDA tensor), the slot's offset and
two interprocess events per slot. The client opens the ring once; its consumer's
stream waits on the slot's ready event before reading (the batch's readiness is that
event, never a host wait), and after its last read records the slot's *free* event on
its stream and releases the slot at once: the daemon's stream waits on the free event
before writing the slot again.

Where CUDA refuses (no memory for the ring; IPC refused in a sandboxed runtime or a
container without a shared IPC namespace) either half raises
:class:`~transport.base.TransportUnavailable`: the daemon then sends over shared
memory, a client asks for it. A ring outlives its stream until no client holds it
(:mod:`transport.ring_holder`): then the daemon gives it back, the only one to touch
its counter.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from core.errors import DataError
from core.gpus import GpuInventory, device_uuid, find_device, normalise_uuid, visible_uuids
from protocol.batch import BatchMeta, to_message
from protos import feeder_pb2
from transport.base import (
    BatchReceiver,
    BatchSender,
    OnceRelease,
    ReceivedBatch,
    ReleaseSink,
    Slot,
    TransportClosed,
    TransportConfig,
    TransportKind,
    TransportUnavailable,
    WireBatch,
    check_shape,
)
from transport.ring import SlotRing
from transport.ring_holder import RingHolder, give_back_share, hold_ring, holder_path, own_counter

# device_uuid, find_device, normalise_uuid and visible_uuids are core.gpus' (the one
# GPU inventory), still importable from here under their old names.
__all__ = [
    "CudaIpcReceiver",
    "CudaIpcSender",
    "device_index",
    "device_uuid",
    "find_device",
    "hold_while_alive",
    "normalise_uuid",
    "refused_as_unavailable",
    "visible_uuids",
]

# How long after its stream closed a ring that was sent stays, even with nobody holding
# it: a client may be about to open it (reading a message sent just before the end).
_OPEN_GRACE_S = 1.0


@contextmanager
def refused_as_unavailable(what: str) -> Iterator[None]:
    """Runs CUDA calls whose failure means "no CUDA IPC here", not a bug: no memory
    (``torch.OutOfMemoryError``), or IPC refused by the driver (sandboxed runtimes,
    containers without a shared IPC namespace: ``torch.AcceleratorError`` from
    ``_share_cuda_``, ``ipc_handle``, ``_new_shared_cuda``, ``from_ipc_handle``). Both
    are ``RuntimeError``s; they become :class:`TransportUnavailable`, so the stream
    falls back to shared memory instead of failing.

    Raises:
        TransportUnavailable: naming ``what`` and the first line of CUDA's message.
    """
    try:
        yield
    except RuntimeError as e:
        detail = (str(e).strip().splitlines() or [""])[0]
        raise TransportUnavailable(f"CUDA IPC: {what}: {type(e).__name__}: {detail}") from e


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device with ``uuid`` ("GPU-...").

    Raises:
        TransportUnavailable: no CUDA, or no visible device with that UUID.
    """
    gpus = GpuInventory.of_this_process()
    if not gpus:
        raise TransportUnavailable("CUDA IPC: no CUDA device in this process")
    index = gpus.find(uuid)
    if index is None:
        raise TransportUnavailable(f"CUDA IPC: device {uuid} is not visible to this process")
    return index


class CudaIpcSender(BatchSender):
    """Daemon half: ``slots`` device slots of ``slot_bytes`` on ``gpu_uuid`` (the
    config's ``ring_slots`` where not given).

    Producers write a slot on its ``stream`` (the ring's own) and seal it
    (:meth:`Slot.seal`), or leave the sealing to :meth:`message`.

    Raises:
        TransportUnavailable: no such device, no memory for the ring, IPC refused.
    """

    kind = TransportKind.CUDA_IPC

    def __init__(self, stream_id: str, config: TransportConfig, slot_bytes: int, gpu_uuid: str,
                 slots: int = 0) -> None:
        self.stream_id = stream_id
        self.device = torch.device("cuda", device_index(gpu_uuid))
        self.slot_bytes = slot_bytes
        slots = slots or config.ring_slots
        self._wait_s = config.slot_wait_s
        self._loans = SlotRing(slots, stream_id)
        self._holder = RingHolder(holder_path(config.shm_dir, stream_id))
        self._handed_out = 0  # messages that carried the ring's handles
        self._closed_s = 0.0
        try:
            with refused_as_unavailable(f"no ring of {slots} x {slot_bytes} bytes on {gpu_uuid}"), \
                    torch.cuda.device(self.device):
                ring = torch.empty(slots * slot_bytes, dtype=torch.uint8, device=self.device)
                # torch's stream priority 0 is CUDA's lowest: the block scheduler runs
                # a training step's kernels (priority 0 or higher) first.
                self.stream = torch.cuda.Stream(self.device, priority=0)
                # The ring is allocated on the current stream but written on its own:
                # once freed, the allocator must not lend its block out again before
                # the writes still queued there have run. Only here, before
                # _share_cuda_: that swaps the storage's deleter for torch's IPC one,
                # and the allocator's record_stream skips memory with another deleter.
                ring.record_stream(self.stream)
                self._ready = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                self._free = [torch.cuda.Event(interprocess=True) for _ in range(slots)]
                self._ring_message = self._describe(ring, gpu_uuid)
            self._ring: torch.Tensor | None = ring
        except BaseException:
            self._holder.retire()  # nobody knows its name yet
            raise

    def _describe(self, ring: torch.Tensor, gpu_uuid: str) -> feeder_pb2.CudaRing:
        """The ring's handles. ``_share_cuda_`` comes last: from then on torch counts
        the ring as held by one consumer (its counter is 1) until :meth:`retire`."""
        ready = [e.ipc_handle() for e in self._ready]
        free = [e.ipc_handle() for e in self._free]
        (_, handle, size, offset, counter, counter_offset, event, sync) = ring.untyped_storage()._share_cuda_()
        self._counter = (counter, counter_offset)
        return feeder_pb2.CudaRing(
            device_uuid=gpu_uuid, storage_handle=handle, storage_size_bytes=size,
            storage_offset_bytes=offset, ref_counter_handle=counter,
            ref_counter_offset=counter_offset, event_handle=event or b"",
            event_sync_required=bool(sync), slot_event_handles=ready, slot_free_event_handles=free,
        )

    def slot_for(self, shape: tuple[int, ...]) -> Slot:
        nbytes = math.prod(shape)
        if nbytes > self.slot_bytes:
            raise ValueError(f"batch of {nbytes} bytes in slots of {self.slot_bytes}")
        loan = None
        while loan is None:  # device slots cannot fall back inline: wait
            loan = self._loans.acquire(self._wait_s)
        index, generation = loan
        ring = self._ring
        if ring is None:  # given back after the stream closed
            raise TransportClosed(f"{self.stream_id}: ring given back")
        # The client released the slot right after enqueueing its last read of it:
        # the write waits for that read on the GPU, not here.
        self.stream.wait_event(self._free[index])
        start = index * self.slot_bytes
        tensor = ring[start : start + nbytes].view(shape)
        return Slot(pixels=tensor, index=index, generation=generation, stream=self.stream, ready=self._ready[index])

    def message(self, slot: Slot, meta: BatchMeta) -> bytes:
        slot.seal()
        message = to_message(meta, slot.shape)
        message.cuda.CopyFrom(feeder_pb2.CudaSlot(
            slot=slot.ref(self.stream_id), offset=slot.index * self.slot_bytes, ring=self._ring_message))
        self._handed_out += 1
        return message.SerializeToString()

    def release(self, index: int, generation: int) -> None:
        self._loans.release(index, generation)

    def close(self) -> None:
        """Ends the stream (waiting producers raise ``TransportClosed``); the ring
        itself goes with :meth:`retire`."""
        if self._loans.close():
            self._closed_s = time.monotonic()

    def retire(self) -> bool:
        """Gives the ring back once the stream has closed and no client holds it or
        can still open it: at once if its handles never left the daemon, else once
        its holder file is free, not within ``_OPEN_GRACE_S`` of the close. Then the
        one consumer's share of torch's counter is given back (no client touches it:
        see :mod:`transport.ring_holder`), and the block is freed at the next
        ``torch.cuda.ipc_collect()`` (the hub's ``collect``).

        Returns:
            True once given back (idempotent).
        """
        if self._ring is None:
            return True
        if not self._loans.closed:
            return False
        if self._handed_out and time.monotonic() - self._closed_s < _OPEN_GRACE_S:
            return False
        if not self._holder.retire():
            return False  # a client holds the ring: its batches may still be read
        give_back_share(*self._counter)
        self._ring, self._ready, self._free = None, [], []
        return True


class CudaIpcReceiver(BatchReceiver):
    """Client half: opens a stream's ring once; each batch is a view of its slot,
    readable once the consumer's stream has waited on the batch's ``ready`` event.

    The consumer must release every batch (``ReceivedBatch.release()`` right after
    enqueueing its last read, on the stream that read): a view of a device ring
    cannot tell when it is unreferenced. The release records the slot's free event on
    the current stream and hands the slot back at once. The ring is held (its holder
    file locked, see :mod:`transport.ring_holder`) as long as any view of it lives.

    Args:
        release: Hands slots back (a ``SlotReleaser``).
        shm_dir: The daemon's ``--shm-dir`` as this process sees it (holder files).
    """

    def __init__(self, release: ReleaseSink, shm_dir: Path = Path("/dev/shm")) -> None:
        self._release = release
        self._shm_dir = Path(shm_dir)
        self._ring_key: bytes = b""
        self._ring: torch.Tensor | None = None
        self._ready: list[torch.cuda.Event] = []
        self._free: list[torch.cuda.Event] = []

    def receive(self, wire: WireBatch) -> ReceivedBatch:
        message = wire.message
        if message.WhichOneof("pixels") != "cuda":
            raise DataError("CUDA IPC batch without a CUDA slot")
        where = message.cuda
        shape = tuple(message.shape)
        nbytes = math.prod(shape) if shape else 0
        check_shape(shape, nbytes)
        ring = self._open(where)
        index = where.slot.index
        if where.offset + nbytes > ring.numel() or not 0 <= index < len(self._ready):
            raise DataError(f"CUDA IPC slot {index} outside the ring")
        images = ring[where.offset : where.offset + nbytes].view(shape)
        ref = feeder_pb2.SlotRef()
        ref.CopyFrom(where.slot)
        free = self._free[index] if index < len(self._free) else None
        return ReceivedBatch(images=images, message=message, ready=self._ready[index],
                             _release=OnceRelease(_FreedOnDevice(self._release, free, ring.device), ref))

    def close(self) -> None:
        self._ring, self._ready, self._free, self._ring_key = None, [], [], b""

    def _open(self, where: feeder_pb2.CudaSlot) -> torch.Tensor:
        """The stream's ring (opened on its first batch: the lock first, then the
        handles, with a counter of this process's). A ring replaced by another (a new
        stream) stays open while batches of it live.

        Raises:
            RingRetired: the daemon gave the ring back before it was opened.
            TransportUnavailable: no such device here, or IPC refused.
        """
        ring = where.ring
        if self._ring is not None and ring.storage_handle == self._ring_key:
            return self._ring
        self._ring, self._ready, self._free = None, [], []
        device = device_index(ring.device_uuid)
        fd = hold_ring(holder_path(self._shm_dir, where.slot.stream_id))
        try:
            with refused_as_unavailable("cannot open the daemon's ring"), torch.cuda.device(device):
                # The storage decrements the counter it is opened with once freed: a
                # counter of this process's, so the daemon's stays the daemon's alone.
                _owner, counter, counter_offset = own_counter(device)
                storage = torch.UntypedStorage._new_shared_cuda(
                    device, ring.storage_handle, ring.storage_size_bytes, ring.storage_offset_bytes,
                    counter, counter_offset, ring.event_handle or None, ring.event_sync_required,
                )
                ready = [torch.cuda.Event.from_ipc_handle(device, h) for h in ring.slot_event_handles]
                free = [torch.cuda.Event.from_ipc_handle(device, h) for h in ring.slot_free_event_handles]
        except BaseException:
            os.close(fd)
            raise
        hold_while_alive(storage, fd, device, free)
        self._ring = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
        self._ready, self._free, self._ring_key = ready, free, ring.storage_handle
        return self._ring


class _FreedOnDevice:
    """A device slot's release: records the slot's free event on the current stream
    (after ``after``, where given), then hands the slot back at once; without a free
    event (a ring that has none), hands it back with an event the releaser waits for."""

    def __init__(self, sink: ReleaseSink, free: torch.cuda.Event | None, device: torch.device) -> None:
        self._sink, self._free, self._device = sink, free, device

    def __call__(self, ref: feeder_pb2.SlotRef, after: torch.cuda.Event | None = None) -> None:
        stream = torch.cuda.current_stream(self._device)
        if after is not None:
            stream.wait_event(after)
        if self._free is None:
            done = torch.cuda.Event()
            done.record(stream)
            self._sink(ref, done)
            return
        self._free.record(stream)
        self._sink(ref, None)


def hold_while_alive(storage: torch.UntypedStorage, fd: int, device: int | None,
                     reads: list[torch.cuda.Event] | None = None) -> None:
    """Closes ``fd`` (the ring's lock) once ``storage`` and every tensor on it are
    gone, after the reads of its last batches have finished (``reads``: the slots'
    free events; without them, the device's work): torch keeps a storage's Python
    object as long as a tensor uses the storage."""
    weakref.finalize(storage, _let_go, fd, device, reads or []).atexit = False  # exit drops the lock anyway


def _let_go(fd: int, device: int | None, reads: list[torch.cuda.Event]) -> None:
    try:
        for event in reads:
            event.synchronize()
        if device is not None and not reads:
            torch.cuda.synchronize(device)
    finally:
        os.close(fd)
