"""The transport interface: how a batch's pixels get from the daemon's producer to
the client's tensor, whatever carries them.

Daemon half, one :class:`BatchSender` per stream::

    slot = sender.slot_for(shape)          # blocks while the ring is full
    np.copyto(slot.array, dali_output)     # the producer's one copy
    data = sender.message(slot, meta)      # serialized Batch; yield it as is
    ...
    sender.release(index, generation)      # from ReleaseSlots
    sender.close()                         # stream over: ring freed, segment unlinked

Client half, one :class:`BatchReceiver` per stream, fed by the raw deserializer
``transport.parse_batch``::

    batch = receiver.receive(wire)         # host (or device) tensor, no copy
    ... batch.images ...                   # CPU consumer: slot returns when unreferenced
    batch.release(after=copy_done_event)   # CUDA consumer: right after its copy

Neither side needs to know which transport is in use.
"""

from __future__ import annotations

import enum
import math
import os
import socket
import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from core.errors import ConfigError, DataError, FeederError
from protocol.batch import BatchMeta, from_message
from protocol.request import ClientHost
from protos import feeder_pb2

if TYPE_CHECKING:  # the daemon's host path runs without torch (a second of every start)
    import torch

__all__ = [
    "BatchReceiver",
    "BatchSender",
    "HostIdentity",
    "ReceivedBatch",
    "ReleaseSink",
    "Slot",
    "TransportClosed",
    "TransportConfig",
    "TransportKind",
    "TransportUnavailable",
    "WireBatch",
    "host_slot",
    "host_tensor",
]


class TransportUnavailable(FeederError):
    """A transport cannot be set up here (``/dev/shm`` full, another host, no GPU, CUDA
    IPC refused); the stream falls back to the next one down (CUDA IPC, shared memory,
    the gRPC payload)."""


class TransportClosed(FeederError):
    """The stream's transport was closed while a producer waited for a slot."""


class TransportKind(enum.Enum):
    """What carries the pixels (values match ``feeder.v1.Transport``)."""

    AUTO = feeder_pb2.TRANSPORT_AUTO
    SHM = feeder_pb2.TRANSPORT_SHM
    GRPC = feeder_pb2.TRANSPORT_GRPC
    CUDA_IPC = feeder_pb2.TRANSPORT_CUDA_IPC


@dataclass(frozen=True)
class TransportConfig:
    """The daemon's transport settings, built once by the CLI.

    Attributes:
        shm_dir: Where shared-memory segments live (a tmpfs).
        ring_slots: Slots per stream ring: batches the daemon may have lent out
            at once, the stream's bound (backpressure).
        shm_budget_bytes: Shared memory all streams together may reserve; a stream
            beyond it gets the gRPC payload.
        slot_wait_s: How long a producer waits for a free slot before sending that
            one batch inline (a consumer that keeps every batch never deadlocks).
        head_reserve_bytes: Room for the small fields in front of the pixels of an
            inline message; larger heads cost one extra copy.
    """

    shm_dir: Path = Path("/dev/shm")
    ring_slots: int = 10  # the daemon's --ring-slots default (feeder.config.ServerConfig)
    shm_budget_bytes: int = 4 << 30
    slot_wait_s: float = 2.0
    head_reserve_bytes: int = 64 << 10

    def __post_init__(self) -> None:
        if self.ring_slots < 1:
            raise ConfigError(f"ring_slots: must be >= 1, got {self.ring_slots}")
        if self.shm_budget_bytes < 0 or self.head_reserve_bytes < 2:
            raise ConfigError("shm_budget_bytes: must be >= 0 (and head_reserve_bytes >= 2)")
        if not self.slot_wait_s > 0:
            raise ConfigError(f"slot_wait_s: must be > 0, got {self.slot_wait_s}")


@dataclass
class Slot:
    """Where the producer writes one batch: lent by :meth:`BatchSender.slot_for`,
    handed on by :meth:`BatchSender.message`.

    A device slot is written on its ``stream`` (the daemon's own, which has waited
    for the client's last read of the slot), and :meth:`seal` then records its
    ``ready`` event there: the client's stream waits on that event, not the host.

    Attributes:
        pixels: uint8 ``[N, H, W, C]`` to fill: a numpy array in host memory, a
            tensor on the client's GPU.
        index: Slot of the ring, or -1 for a batch that travels inline.
        generation: Times this slot has been lent; names this loan in releases.
        keep: What the memory belongs to (kept alive with the slot).
        stream: Where a device slot is written (None for host memory).
        ready: Recorded on ``stream`` once the slot is written (device slots).
    """

    pixels: np.ndarray | torch.Tensor
    index: int = -1
    generation: int = 0
    keep: object = None
    stream: torch.cuda.Stream | None = None
    ready: torch.cuda.Event | None = None
    sealed: bool = False

    def seal(self) -> None:
        """Says the slot is written (every write enqueued on ``stream``): records
        ``ready`` there, once; nothing for host memory."""
        if self.ready is not None and not self.sealed:
            self.ready.record(self.stream)
            self.sealed = True

    @property
    def on_gpu(self) -> bool:
        """Whether the slot is device memory (a tensor), not host memory."""
        return not isinstance(self.pixels, np.ndarray)

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.pixels.shape)

    @property
    def array(self) -> np.ndarray:
        """The slot as a writable numpy array (host slots only; no copy)."""
        if not isinstance(self.pixels, np.ndarray):
            raise TypeError(f"slot on {self.pixels.device} has no numpy view")
        return self.pixels

    @property
    def tensor(self) -> torch.Tensor:
        """The slot's device tensor (device slots only)."""
        if isinstance(self.pixels, np.ndarray):
            raise TypeError("a host slot is a numpy array, not a device tensor")
        return self.pixels

    def ref(self, stream_id: str) -> feeder_pb2.SlotRef:
        """How the client names this loan when it hands the slot back."""
        return feeder_pb2.SlotRef(stream_id=stream_id, index=self.index, generation=self.generation)


def host_tensor(pixels: np.ndarray) -> torch.Tensor:
    """The client's tensor over ``pixels`` in host memory (no copy): torch is the
    client's, imported on its first batch, never by the daemon."""
    import torch

    return torch.from_numpy(pixels)


def host_slot(shape: tuple[int, ...]) -> Slot:
    """A slot of fresh host memory for a uint8 batch of ``shape`` (no transport: a
    batch decoded in this process)."""
    return Slot(pixels=np.empty(shape, dtype=np.uint8))


class BatchSender(ABC):
    """The daemon's half of a transport, for one stream."""

    kind: TransportKind
    stream_id: str

    @abstractmethod
    def slot_for(self, shape: tuple[int, ...]) -> Slot:
        """A slot for a uint8 batch of ``shape``; waits while the ring is full.

        Raises:
            TransportClosed: the sender was closed meanwhile.
        """

    @abstractmethod
    def message(self, slot: Slot, meta: BatchMeta) -> bytes:
        """The serialized ``Batch`` for a filled ``slot`` (pixels inline, or a
        reference to the slot). The slot's memory must not be written again."""

    @abstractmethod
    def release(self, index: int, generation: int) -> None:
        """The client gave slot ``index`` (loan ``generation``) back.

        Raises:
            InvalidArgument: no such slot, not lent (released twice) or a stale
                generation; the ring is unchanged.
        """

    @abstractmethod
    def close(self) -> None:
        """Frees the stream's buffers (unlinks its segment). Idempotent."""

    def retire(self) -> bool:
        """After :meth:`close`: gives back what may outlive the stream (a device ring
        a client still holds); True once nothing is left. Called again until True."""
        return True

    @property
    def reserved_bytes(self) -> int:
        """Shared memory this sender holds (counted against the daemon's budget)."""
        return 0


@dataclass(frozen=True)
class WireBatch:
    """A received ``Batch`` as the raw deserializer leaves it.

    Attributes:
        message: Every field but ``images`` (and the filler).
        data: The received bytes.
        pixels_offset: Where the ``images`` field's value starts in ``data``; -1
            when the pixels are in a slot.
        pixels_nbytes: Its length.
    """

    message: feeder_pb2.Batch
    data: bytes
    pixels_offset: int = -1
    pixels_nbytes: int = 0

    @property
    def pixels(self) -> memoryview | None:
        """The ``images`` field as a view of ``data`` (None without one)."""
        if self.pixels_offset < 0:
            return None
        return memoryview(self.data)[self.pixels_offset : self.pixels_offset + self.pixels_nbytes]


# Hands a slot back: (slot, CUDA event the consumer's reads are ordered before, or
# None). Called from any thread, including finalizers: it must not block.
ReleaseSink = Callable[[feeder_pb2.SlotRef, "torch.cuda.Event | None"], None]


@dataclass
class ReceivedBatch:
    """One batch on the client, pixels not copied.

    Attributes:
        images: uint8 ``[N, H, W, C]``, in host memory (shm, gRPC) or on the
            client's GPU (CUDA IPC).
        message: The received message (its pixels cut out).
        ready: For device ``images``: the event the consumer's stream waits on
            before reading them (the daemon's write); None in host memory.
    """

    images: torch.Tensor
    message: feeder_pb2.Batch
    _release: Callable[[torch.cuda.Event | None], None] | None = field(default=None, repr=False)
    ready: torch.cuda.Event | None = None

    @property
    def meta(self) -> BatchMeta:
        """The batch's small fields (epoch, cursor, keys, labels, padding, ...)."""
        return from_message(self.message)

    def release(self, after: torch.cuda.Event | None = None) -> None:
        """Hands the slot back now (once ``after`` has completed; for device
        ``images``, once the current stream's work enqueued so far has): call it as
        soon as ``images`` has been copied elsewhere; ``images`` must not be used again.
        Without a call the slot returns when ``images`` is no longer referenced
        (host slots). Idempotent; nothing to do for inline pixels."""
        if self._release is not None:
            self._release(after)


class BatchReceiver(ABC):
    """The client's half of a transport, for one stream."""

    @abstractmethod
    def receive(self, wire: WireBatch) -> ReceivedBatch:
        """The batch's pixels as a tensor, without copying them.

        Raises:
            DataError: a message whose sizes or references do not add up.
            TransportUnavailable: the slot's memory cannot be opened here.
        """

    def close(self) -> None:
        """Drops per-stream mappings (batches still referenced stay valid)."""


class OnceRelease:  # shared by the slot-based receivers
    """Calls ``sink(ref, after)`` at most once, from whichever thread comes first
    (the consumer's explicit release or the finalizer of the batch's memory)."""

    def __init__(self, sink: ReleaseSink, ref: feeder_pb2.SlotRef) -> None:
        self._sink = sink
        self._ref = ref
        self._lock = threading.Lock()

    def __call__(self, after: torch.cuda.Event | None = None) -> None:
        if self._lock.acquire(blocking=False):  # never released: one call only
            self._sink(self._ref, after)


def check_shape(shape: tuple[int, ...], nbytes: int) -> None:
    """Raises ``DataError`` unless ``shape`` is ``[N, H, W, 3]`` of ``nbytes`` bytes."""
    if len(shape) != 4 or shape[3] != 3 or min(shape) < 0:
        raise DataError(f"batch with shape {list(shape)}, expected [N, H, W, 3]")
    if math.prod(shape) != nbytes:
        raise DataError(f"batch of {nbytes} bytes does not match shape {list(shape)}")


class _HostMemory:
    """``nbytes`` at ``address`` as a numpy buffer, keeping ``owner`` alive."""

    def __init__(self, address: int, nbytes: int, owner: object) -> None:
        self.owner = owner
        self.__array_interface__ = {
            "version": 3,
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (address, False),  # writable
        }


def wrap_memory(address: int, nbytes: int, owner: object, on_free: Callable[[], None] | None = None) -> np.ndarray:
    """A writable uint8 array over ``nbytes`` at ``address`` (no copy).

    ``owner`` (what the memory belongs to) stays alive while the array, or anything
    made from it (numpy views, ``torch.from_numpy`` and every view of that tensor),
    does; ``on_free`` runs once the last of them is gone. That is how a slot goes
    back to the daemon when the batch is no longer referenced, whatever the user
    kept of it.
    """
    holder = _HostMemory(address, nbytes, owner)
    if on_free is not None:
        # Not at interpreter exit: the daemon reclaims the ring when the stream ends.
        weakref.finalize(holder, on_free).atexit = False
    return np.asarray(holder)


@dataclass(frozen=True)
class HostIdentity:
    """Which kernel and which shm filesystem a process sees.

    Two processes can share a segment when both match: the same boot id (same
    kernel) and the same ``st_dev`` of the shm directory (same tmpfs instance; a
    container with a private ``/dev/shm`` differs). The hostname is for messages.
    """

    boot_id: str
    hostname: str
    shm_device: int
    pid: int = 0  # the process (for the daemon's per-client limits; 0: not said)

    @classmethod
    def of_this_process(cls, shm_dir: Path = Path("/dev/shm")) -> HostIdentity:
        """This process's identity (read from ``/proc`` and ``shm_dir``)."""
        try:
            boot_id = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        except OSError:
            boot_id = ""
        try:
            shm_device = os.stat(shm_dir).st_dev
        except OSError:
            shm_device = 0
        return cls(boot_id=boot_id, hostname=socket.gethostname(), shm_device=shm_device, pid=os.getpid())

    def client_host(self, gpu_uuid: str = "") -> ClientHost:
        """What a client in this process says of where it runs (its request's
        ``client_host``), reading on ``gpu_uuid`` (empty: a CPU consumer)."""
        return ClientHost(boot_id=self.boot_id, hostname=self.hostname, shm_device=self.shm_device,
                          gpu_uuid=gpu_uuid, pid=self.pid)

    def shares_shm_with(self, other: HostIdentity | ClientHost) -> bool:
        """True when a segment made by one is visible to the other."""
        return bool(self.boot_id) and self.boot_id == other.boot_id and self.shm_device == other.shm_device
