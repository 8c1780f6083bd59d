"""CUDA IPC: a ring of device buffers on the client's GPU, allocated by the daemon
and shared once per stream; batches never go through host memory.

The daemon's pipeline runs on the client's GPU (named by UUID: device indices
differ per process with CUDA_VISIBLE_DEVICES) and writes each batch into a slot
of the ring, then records the slot's interprocess event. The message carries the
ring's IPC handles (torch's ``UntypedStorage._share_cuda_``, as
``torch/multiprocessing/reductions.py`` sends a CUDA tensor), the slot's offset and
the event handles. The client opens the ring once, makes its stream wait on the
slot's event, and releases the slot after its own work on it (an event it records
after the copy/convert), exactly like a shared-memory slot.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from core.errors import DataError
from protocol.batch import BatchMeta, to_message
from protos import feeder_pb2
from transport.base import (
    BatchReceiver,
    BatchSender,
    OnceRelease,
    ReceivedBatch,
    ReleaseSink,
    Slot,
    TransportConfig,
    TransportKind,
    TransportUnavailable,
    WireBatch,
    check_shape,
)
from transport.ring import SlotRing

__all__ = [
    "CudaIpcReceiver",
    "CudaIpcSender",
    "device_index",
    "device_uuid",
    "find_device",
    "normalise_uuid",
    "visible_uuids",
]

_UUID_PREFIXES = ("GPU-", "MIG-")


def normalise_uuid(uuid: str) -> str:
    """``uuid`` as nvidia-smi writes it: ``GPU-`` (or ``MIG-``) and lower-case hex.
    torch's ``device_properties.uuid`` prints without the prefix, NVML with it."""
    uuid = uuid.strip()
    prefix = next((p for p in _UUID_PREFIXES if uuid.upper().startswith(p)), "GPU-")
    body = uuid[len(prefix):] if uuid.upper().startswith(prefix) else uuid
    return prefix + body.lower()


def find_device(uuid: str, uuids: Sequence[str]) -> int | None:
    """Index of ``uuid`` in ``uuids`` (a process's devices, in its index order),
    whichever way either is written; None when it is not there."""
    if not uuid:
        return None
    wanted = normalise_uuid(uuid)
    return next((i for i, u in enumerate(uuids) if normalise_uuid(u) == wanted), None)


def device_uuid(index: int) -> str:
    """UUID ("GPU-...") of this process's CUDA device ``index``."""
    return normalise_uuid(str(torch.cuda.get_device_properties(index).uuid))


def visible_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by index (empty without CUDA)."""
    if not torch.cuda.is_available():
        return []
    return [device_uuid(i) for i in range(torch.cuda.device_count())]


def device_index(uuid: str) -> int:
    """This process's index of the CUDA device with ``uuid`` ("GPU-...").

    Raises:
        TransportUnavailable: no CUDA, or no visible device with that UUID.
    """
    if not torch.cuda.is_available():
        raise TransportUnavailable("CUDA IPC: no CUDA device in this process")
    index = find_device(uuid, visible_uuids())
    if index is None:
        raise TransportUnavailable(f"CUDA IPC: device {uuid} is not visible to this process")
    return index


class CudaIpcSender(BatchSender):
    """Daemon half: ``ring_slots`` device slots of ``slot_bytes`` on ``gpu_uuid``.

    Producers write a slot on the device's current stream of the thread that calls
    :meth:`message` (or finish their writes before it): ``message`` records the
    slot's event there.

    Raises:
        TransportUnavailable: no such device, or no memory for the ring.
    """

    kind = TransportKind.CUDA_IPC

    def __init__(self, stream_id: str, config: TransportConfig, slot_bytes: int, gpu_uuid: str) -> None:
        self.stream_id = stream_id
        self.device = torch.device("cuda", device_index(gpu_uuid))
        self.slot_bytes = slot_bytes
        self._wait_s = config.slot_wait_s
        self._loans = SlotRing(config.ring_slots, stream_id)
        try:
            self._ring = torch.empty(config.ring_slots * slot_bytes, dtype=torch.uint8, device=self.device)
        except torch.OutOfMemoryError as e:
            raise TransportUnavailable(f"CUDA IPC: no room for the ring on {gpu_uuid}: {e}") from e
        self._events = [torch.cuda.Event(interprocess=True) for _ in range(config.ring_slots)]
        self._ring_message = self._describe(gpu_uuid)

    def _describe(self, gpu_uuid: str) -> feeder_pb2.CudaRing:
        with torch.cuda.device(self.device):
            (_, handle, size, offset, counter, counter_offset, event, sync) = (
                self._ring.untyped_storage()._share_cuda_()
            )
            events = [e.ipc_handle() for e in self._events]
        return feeder_pb2.CudaRing(
            device_uuid=gpu_uuid, storage_handle=handle, storage_size_bytes=size,
            storage_offset_bytes=offset, ref_counter_handle=counter,
            ref_counter_offset=counter_offset, event_handle=event or b"",
            event_sync_required=bool(sync), slot_event_handles=events,
        )

    def slot_for(self, shape: tuple[int, ...]) -> Slot:
        nbytes = math.prod(shape)
        if nbytes > self.slot_bytes:
            raise ValueError(f"batch of {nbytes} bytes in slots of {self.slot_bytes}")
        loan = None
        while loan is None:  # device slots cannot fall back inline: wait
            loan = self._loans.acquire(self._wait_s)
        index, generation = loan
        start = index * self.slot_bytes
        tensor = self._ring[start : start + nbytes].view(shape)
        return Slot(tensor=tensor, index=index, generation=generation)

    def message(self, slot: Slot, meta: BatchMeta) -> bytes:
        self._events[slot.index].record(torch.cuda.current_stream(self.device))
        message = to_message(meta, tuple(slot.tensor.shape))
        message.cuda.CopyFrom(feeder_pb2.CudaSlot(
            slot=slot.ref(self.stream_id), offset=slot.index * self.slot_bytes, ring=self._ring_message))
        return message.SerializeToString()

    def release(self, index: int, generation: int) -> None:
        self._loans.release(index, generation)

    def close(self) -> None:
        self._loans.close()


class CudaIpcReceiver(BatchReceiver):
    """Client half: opens a stream's ring once; each batch is a view of its slot,
    ready once the current stream has waited on the slot's event.

    The consumer must release every batch (``ReceivedBatch.release(after=event)``
    after its copy): a view of a device ring cannot tell when it is unreferenced.
    """

    def __init__(self, release: ReleaseSink) -> None:
        self._release = release
        self._ring_key: bytes = b""
        self._ring: torch.Tensor | None = None
        self._events: list[torch.cuda.Event] = []

    def receive(self, wire: WireBatch) -> ReceivedBatch:
        message = wire.message
        if message.WhichOneof("pixels") != "cuda":
            raise DataError("CUDA IPC batch without a CUDA slot")
        where = message.cuda
        shape = tuple(message.shape)
        nbytes = math.prod(shape) if shape else 0
        check_shape(shape, nbytes)
        ring = self._open(where.ring)
        if where.offset + nbytes > ring.numel() or not 0 <= where.slot.index < len(self._events):
            raise DataError(f"CUDA IPC slot {where.slot.index} outside the ring")
        torch.cuda.current_stream(ring.device).wait_event(self._events[where.slot.index])
        images = ring[where.offset : where.offset + nbytes].view(shape)
        ref = feeder_pb2.SlotRef()
        ref.CopyFrom(where.slot)
        return ReceivedBatch(images=images, message=message, _release=OnceRelease(self._release, ref))

    def close(self) -> None:
        self._ring, self._events, self._ring_key = None, [], b""

    def _open(self, ring: feeder_pb2.CudaRing) -> torch.Tensor:
        if self._ring is None or ring.storage_handle != self._ring_key:
            device = device_index(ring.device_uuid)
            with torch.cuda.device(device):
                storage = torch.UntypedStorage._new_shared_cuda(
                    device, ring.storage_handle, ring.storage_size_bytes, ring.storage_offset_bytes,
                    ring.ref_counter_handle, ring.ref_counter_offset,
                    ring.event_handle or None, ring.event_sync_required,
                )
                self._events = [torch.cuda.Event.from_ipc_handle(device, h) for h in ring.slot_event_handles]
            self._ring = torch.empty(0, dtype=torch.uint8, device=f"cuda:{device}").set_(storage)
            self._ring_key = ring.storage_handle
        return self._ring

