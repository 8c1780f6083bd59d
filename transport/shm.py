"""Shared memory: a ring of slots per stream in one segment under ``/dev/shm``, for
clients on the daemon's host. The pixels are copied once, by the producer, into a
slot; the ``Batch`` message carries only the slot's reference; the client's tensor
is a view of the slot, and the slot goes back when the client writes the loan's
generation into the slot's release word at the end of the segment (no call; the
daemon reads the words when it needs a slot). ``ReleaseSlots`` remains for releases
that wait on a CUDA event.

Segments never outlive their owner for long:

- the daemon owns them: created owner-only (0600) with ``O_EXCL``, named
  ``feeder-<pid>-<token>-<stream no>`` (a prefix unique to the daemon instance),
  unlinked when the stream closes (end, cancellation, SIGTERM via the daemon's
  ``close_all``). A client only maps them, so a client killed with SIGKILL leaves
  nothing behind;
- the daemon holds an ``flock`` on each of its segments from before the segment has
  its name (made under ``<name>.new``, locked, then linked to its name), so a
  segment whose lock is free has no owner: :func:`sweep_stale`, run at daemon start,
  removes those. Ownership is the lock alone, never the pid in the name: after a
  container restart on the same memory-backed ``/dev/shm``, pids start again from 1
  and the dead daemon's pid may be a live process's (or the new daemon's own), and a
  daemon in another pid namespace sharing the directory has a pid this one cannot see;
- space is reserved with ``posix_fallocate`` when the ring is made, so a full or
  small ``/dev/shm`` is an exception then (:class:`TransportUnavailable`, the
  daemon falls back to the gRPC payload), never a SIGBUS at first touch.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import math
import mmap
import os
import re
import secrets
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

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
    host_tensor,
    wrap_memory,
)
from transport.grpc_payload import GrpcPayloadSender
from transport.ring import SlotRing

if TYPE_CHECKING:
    import torch

__all__ = ["ShmReceiver", "ShmRing", "ShmSender", "instance_prefix", "sweep_stale"]

_log = logging.getLogger(__name__)
_NAME = re.compile(r"^feeder-(\d+)-([0-9a-f]+)-(\d+)$")
# A CUDA IPC ring's holder file (transport.ring_holder): nobody may hold its lock while
# its daemon lives, so only a dead owner makes it stale.
_HOLDER = re.compile(r"^feeder-(\d+)-([0-9a-f]+)-(\d+)\.cuda$")
# A segment being made: locked at once, linked to its name, then unlinked.
_MAKING = re.compile(r"^feeder-(\d+)-([0-9a-f]+)-(\d+)\.new$")
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FLAGS = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
_WORD = 8  # bytes of a release word
# How often a producer waiting for a slot reads the release words (clients release in
# the segment without waking it): short against a batch, long against the lock.
_WORD_POLL_S = 0.0005


def instance_prefix() -> str:
    """A segment-name prefix unique to this daemon instance: ``feeder-<pid>-<token>-``."""
    return f"feeder-{os.getpid()}-{secrets.token_hex(4)}-"


class ShmRing(SlotRing):
    """``slots`` slots of ``slot_bytes`` in one segment at ``path``, with their loans
    (:class:`transport.ring.SlotRing`).

    After the slots, the segment ends with one release word per slot (little-endian
    uint64 at ``release_offset``): a client that writes a loan's generation there
    gives the slot back without a call (the ring reads the words while a producer
    waits for a slot); a word holding anything else frees nothing.

    Raises:
        TransportUnavailable: the segment cannot be made or its space reserved.
    """

    def __init__(self, path: Path, slots: int, slot_bytes: int) -> None:
        if slots < 1 or slot_bytes < 1:
            raise ValueError(f"ring of {slots} slots of {slot_bytes} bytes")
        super().__init__(slots, Path(path).name, poll_s=_WORD_POLL_S)
        self.path = Path(path)
        self.slot_bytes = slot_bytes
        self.release_offset = slots * slot_bytes
        self.nbytes = self.release_offset + _WORD * slots
        self._fd, self._map = _create_segment(self.path, self.nbytes)
        self._memory = np.frombuffer(self._map, dtype=np.uint8)
        self._words = self._memory[self.release_offset :].view("<u8")

    def reclaim(self, index: int, generation: int) -> bool:
        return int(self._words[index]) == generation

    def view(self, index: int, nbytes: int) -> np.ndarray:
        """The first ``nbytes`` of slot ``index`` (writable, no copy)."""
        start = index * self.slot_bytes
        return self._memory[start : start + nbytes]

    def close(self) -> bool:
        """Unlinks the segment and wakes waiting producers. Idempotent."""
        with self._cond:
            if self.closed:
                return False
            _unlink(self.path)  # before a woken producer can see the ring closed
            super().close()
        os.close(self._fd)  # drops the lock
        self._memory = np.empty(0, dtype=np.uint8)
        self._words = np.zeros(self.slots, dtype="<u8")
        try:
            self._map.close()
        except BufferError:
            pass  # slot views still alive: unmapped when the last one goes
        return True


def _create_segment(path: Path, nbytes: int) -> tuple[int, mmap.mmap]:
    making = path.with_name(path.name + ".new")
    try:
        fd = os.open(making, _CREATE_FLAGS, 0o600)
    except OSError as e:
        raise TransportUnavailable(f"cannot create {making}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # "owner alive" for sweep_stale
        os.fchmod(fd, 0o600)  # whatever the umask
        os.posix_fallocate(fd, 0, nbytes)
        os.link(making, path)  # named only once locked (and, like O_EXCL, never over another)
        # Populated now: the stream's first batches do not pay the page faults.
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        return fd, mmap.mmap(fd, nbytes, flags, mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as e:
        os.close(fd)
        _unlink(path)
        hint = " (shared memory full or too small)" if e.errno in (errno.ENOSPC, errno.ENOMEM) else ""
        raise TransportUnavailable(f"cannot reserve {nbytes} bytes in {path}: {e.strerror}{hint}") from e
    finally:
        _unlink(making)


def _unlink(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class ShmSender(BatchSender):
    """Daemon half: batches go into the ring; a batch that does not fit a slot, or
    finds no free slot within ``slot_wait_s`` (a consumer keeping every batch),
    travels inline instead, so the stream never deadlocks.

    Args:
        stream_id: Segment name, ``instance_prefix() + str(stream_no)``.
        config: Ring size, directory and waits.
        slot_bytes: Size of one slot: the stream's largest batch.

    Raises:
        TransportUnavailable: the segment cannot be made (the caller falls back).
    """

    kind = TransportKind.SHM

    def __init__(self, stream_id: str, config: TransportConfig, slot_bytes: int) -> None:
        self.stream_id = stream_id
        self._wait_s = config.slot_wait_s
        self.ring = ShmRing(Path(config.shm_dir) / stream_id, config.ring_slots, slot_bytes)
        self._inline = GrpcPayloadSender(stream_id, config.head_reserve_bytes)
        self.inline_batches = 0  # batches that missed the ring

    @property
    def reserved_bytes(self) -> int:
        return self.ring.nbytes

    def slot_for(self, shape: tuple[int, ...]) -> Slot:
        nbytes = math.prod(shape)
        loan = self.ring.acquire(self._wait_s) if nbytes <= self.ring.slot_bytes else None
        if loan is None:
            self.inline_batches += 1
            _log.debug("stream %s: batch of %d bytes sent inline", self.stream_id, nbytes)
            return self._inline.slot_for(shape)
        index, generation = loan
        pixels = self.ring.view(index, nbytes).reshape(shape)
        return Slot(pixels=pixels, index=index, generation=generation)

    def message(self, slot: Slot, meta: BatchMeta) -> bytes:
        if slot.index < 0:
            return self._inline.message(slot, meta)
        message = to_message(meta, slot.shape)
        message.shm.CopyFrom(feeder_pb2.ShmSlot(
            slot=slot.ref(self.stream_id), offset=slot.index * self.ring.slot_bytes, segment=self.stream_id,
            segment_bytes=self.ring.nbytes, release_offset=self.ring.release_offset))
        return message.SerializeToString()

    def release(self, index: int, generation: int) -> None:
        self.ring.release(index, generation)

    def close(self) -> None:
        self.ring.close()


class ShmReceiver(BatchReceiver):
    """Client half: maps each stream's segment once and wraps slots as tensors.

    A slot goes back through ``release`` (the ``ReleaseSink``) when the consumer
    calls ``ReceivedBatch.release`` or, failing that, when the batch's memory is no
    longer referenced (any view of the tensor keeps it).

    Args:
        release: Hands slots back to the daemon (non-blocking).
        shm_dir: The shm directory (the daemon's, as seen from here).
    """

    def __init__(self, release: ReleaseSink, shm_dir: Path = Path("/dev/shm")) -> None:
        self._release = release
        self._dir = Path(shm_dir)
        self._maps: dict[str, np.ndarray] = {}

    def receive(self, wire: WireBatch) -> ReceivedBatch:
        message = wire.message
        if message.WhichOneof("pixels") != "shm" or not message.shm.HasField("slot"):
            raise DataError("shared-memory batch without a slot reference")
        where = message.shm
        shape = tuple(message.shape)
        nbytes = math.prod(shape) if shape else 0
        check_shape(shape, nbytes)
        segment = self._segment(where.segment, where.segment_bytes)
        if where.offset + nbytes > segment.nbytes:
            raise DataError(f"{where.segment}: slot at {where.offset}+{nbytes} outside {segment.nbytes} bytes")
        ref = feeder_pb2.SlotRef()
        ref.CopyFrom(where.slot)
        sink = self._release
        if where.release_offset:  # in-band: the slot's word in the segment
            sink = _word_release(segment, where.release_offset, self._release)
        once = OnceRelease(sink, ref)
        address = segment.ctypes.data + where.offset
        pixels = wrap_memory(address, nbytes, owner=segment, on_free=once).reshape(shape)
        return ReceivedBatch(images=host_tensor(pixels), message=message, _release=once)

    def close(self) -> None:
        # Batches still referenced keep their mapping (through wrap_memory's owner).
        self._maps.clear()

    def _segment(self, name: str, nbytes: int) -> np.ndarray:
        if name not in self._maps:
            if not _NAME.match(name):
                raise DataError(f"shm segment name {name!r} is not one of the daemon's")
            self._maps = {name: _map_segment(self._dir / name, nbytes)}  # one per stream
        return self._maps[name]


def _word_release(segment: np.ndarray, offset: int, fallback: ReleaseSink) -> ReleaseSink:
    """A release sink that writes the loan's generation into the slot's release word
    (the daemon frees the slot when it next looks); one with a CUDA event to wait for
    goes through ``fallback`` (the call), which waits off the consumer's thread."""
    words = segment[offset:].view("<u8")

    def release(ref: feeder_pb2.SlotRef, after: torch.cuda.Event | None = None) -> None:
        if after is not None or not 0 <= ref.index < len(words):
            fallback(ref, after)
            return
        # Written after the consumer's last read of the slot (program order; x86
        # keeps loads before later stores), and only ever read by the daemon.
        words[ref.index] = ref.generation

    return release


def _map_segment(path: Path, nbytes: int) -> np.ndarray:
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise TransportUnavailable(f"cannot open shared memory {path}: {e.strerror}") from e
    try:
        size = os.fstat(fd).st_size
        if size < nbytes or nbytes <= 0:
            raise DataError(f"{path}: {size} bytes, the daemon announced {nbytes}")
        mapped = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)  # the mapping stays; the daemon alone holds the file
    return np.frombuffer(mapped, dtype=np.uint8)


def sweep_stale(shm_dir: Path | str = "/dev/shm") -> list[str]:
    """Removes segments whose daemon is gone; call it at daemon start.

    A segment (or one being made) is stale when no process holds its lock: its
    daemon is gone, whatever pid now has the number in its name. Segments of other
    users are left alone. CUDA IPC holder files (empty) go when their owner pid no
    longer exists.

    Returns:
        The names removed.
    """
    removed = []
    for entry in os.scandir(shm_dir):
        segment = _NAME.match(entry.name) or _MAKING.match(entry.name)
        holder = _HOLDER.match(entry.name)
        stale = bool(segment and _unlocked(Path(entry.path)))
        if stale or (holder and not _pid_alive(int(holder.group(1)))):
            try:
                os.unlink(entry.path)
            except (FileNotFoundError, PermissionError):
                continue
            removed.append(entry.name)
    if removed:
        _log.info("removed %d stale shared-memory segment(s) from %s", len(removed), shm_dir)
    return removed


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # alive, another user's
    return True


def _unlocked(path: Path) -> bool:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True  # nobody holds it
    except OSError:
        return False
    finally:
        os.close(fd)
