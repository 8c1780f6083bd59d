"""Who still holds a CUDA IPC ring: a lock file beside the stream's shared memory.

torch counts a CUDA block shared with ``UntypedStorage._share_cuda_`` as held by one
consumer until that consumer's storage is freed: the producer's copy of the block
waits in torch's "limbo" while the counter is above 0, and only the consumer's storage
deleter (``_new_shared_cuda``'s) decrements it. A client that never opened the ring (a
stream cancelled before its first batch was read), or was killed, never does: the
ring, 10 slots of a batch, would stay allocated for the daemon's life.

So each ring has a holder file, ``<stream id>.cuda`` in the daemon's ``--shm-dir``:

- the client takes a shared ``flock`` on it *before* it opens the ring, and keeps it
  while any view of the ring lives (released by a finalizer of the ring's storage;
  the kernel drops it when the process dies, however it dies);
- once the stream has ended, the daemon takes it exclusively (non-blocking). Holding
  it proves no client holds the ring: the daemon unlinks the file and gives the
  client's share of torch's counter back (:func:`give_back_share`), and the block is
  freed at the next ``torch.cuda.ipc_collect()``;
- a client that comes to the ring after that (it read a message of a stream that had
  ended meanwhile) finds the file gone, or unlinked under its lock, and does not open
  the ring: :class:`RingRetired`, and it asks for the rest of the stream again.

Exactly one party decrements the ring's counter: the daemon, once. A client opens the
ring with a counter of its own (:func:`own_counter`: torch's consumer storage always
decrements the counter it was opened with when it is freed, so it is given one that
only it uses), never the daemon's; the daemon gives its one share back when it
retires the ring, and only while the counter is above 0 (torch's counter is unsigned:
a second decrement would wrap it to 2**64 - 1, and the block would stay in limbo for
the daemon's life). No client decrement races the daemon's: there is none. Nothing
here needs a GPU but :func:`own_counter`.
"""

from __future__ import annotations

import fcntl
import mmap
import os
import re
import struct
from pathlib import Path

from transport.base import TransportClosed, TransportUnavailable

__all__ = ["RingHolder", "RingRetired", "counter_value", "give_back_share", "hold_ring", "holder_path", "own_counter"]

_SUFFIX = ".cuda"
_STREAM_ID = re.compile(r"^feeder-\d+-[0-9a-f]+-\d+$")  # transport.shm.instance_prefix + a number
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
# torch's IPC counter files (``torch/csrc/CudaIPCTypes.h``): shm objects made by
# at::RefcountedMapAllocator, a 64-byte header (its own mapping count) and then
# CUDA_IPC_REF_COUNTER_FILE_SIZE counters of 8 bytes, unsigned.
_COUNTER_HEADER_BYTES = 64
_COUNTER = struct.Struct("<Q")


class RingRetired(TransportClosed):
    """The ring was given back before this client opened it (its stream had ended):
    the batches it carried must be asked for again."""


def holder_path(shm_dir: Path, stream_id: str) -> Path:
    """The holder file of stream ``stream_id``'s ring.

    Raises:
        TransportUnavailable: ``stream_id`` is not a name the daemon gives.
    """
    if not _STREAM_ID.match(stream_id):
        raise TransportUnavailable(f"CUDA IPC: stream id {stream_id!r} is not one of a daemon's")
    return Path(shm_dir) / f"{stream_id}{_SUFFIX}"


class RingHolder:
    """The daemon's half: makes the holder file (owner-only) and retires it.

    Raises:
        TransportUnavailable: the file cannot be made.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            self._fd: int | None = os.open(path, _CREATE_FLAGS, 0o600)
        except OSError as e:
            raise TransportUnavailable(f"CUDA IPC: cannot create {path}: {e.strerror}") from e

    def retire(self) -> bool:
        """Takes the file if no client holds it, and unlinks it: after True, no client
        holds the ring or will open it. Idempotent (True once retired)."""
        if self._fd is None:
            return True
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # a client holds the ring
        self._drop()
        return True

    def _drop(self) -> None:
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass  # swept already
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def hold_ring(path: Path) -> int:
    """The client's half: a descriptor holding a shared lock on ``path``; close it
    once the last view of the ring is gone (and its reads have finished).

    Raises:
        RingRetired: the daemon gave the ring back already.
        TransportUnavailable: the file cannot be opened here (another user, another
            ``/dev/shm``).
    """
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except FileNotFoundError as e:
        raise RingRetired(f"CUDA IPC ring {path.name} was given back before it was opened") from e
    except OSError as e:
        raise TransportUnavailable(f"CUDA IPC: cannot open {path}: {e.strerror}") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while the daemon retires it
        if os.fstat(fd).st_nlink == 0:
            raise RingRetired(f"CUDA IPC ring {path.name} was given back while it was being opened")
    except BaseException:
        os.close(fd)
        raise
    return fd


def counter_value(counter_handle: bytes, counter_offset: int, shm_root: Path = Path("/dev/shm")) -> int | None:
    """The value of torch's IPC counter ``counter_offset`` in the file ``counter_handle``
    (an shm name, "/torch_..."); None when the file is gone (its producer exited)."""
    name = counter_handle.decode(errors="replace").lstrip("/")
    if not name or "/" in name:
        return None
    try:
        fd = os.open(shm_root / name, _OPEN_FLAGS)
    except OSError:
        return None
    try:
        at = _COUNTER_HEADER_BYTES + _COUNTER.size * counter_offset
        if counter_offset < 0 or os.fstat(fd).st_size < at + _COUNTER.size:
            return None
        with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as view:
            return int(_COUNTER.unpack_from(view, at)[0])
    finally:
        os.close(fd)


def give_back_share(counter_handle: bytes, counter_offset: int) -> bool:
    """Gives back the one consumer's share torch counts for a block shared with
    ``_share_cuda_`` (what a consumer's storage deleter does), unless the counter is
    0 already (a client that opened the ring with the daemon's own counter, and let
    go of it, gave it back itself). A counter file already gone is ignored, as torch
    does.

    Returns:
        True when it decremented the counter.
    """
    import torch

    value = counter_value(counter_handle, counter_offset)
    if not value:
        return False
    torch.UntypedStorage._release_ipc_counter_cuda(counter_handle, counter_offset)
    return True


def own_counter(device: int) -> tuple[object, bytes, int]:
    """A counter of this process's for a consumer storage to decrement when it is freed
    (``_new_shared_cuda`` takes one and always decrements it): a 1-byte block of this
    process's, shared with ``_share_cuda_`` only to get a counter of torch's set to 1.

    Returns:
        ``(owner, handle, offset)``: keep ``owner`` until the consumer storage is
        opened; once both are gone torch frees the block (its counter is then 0).
    """
    import torch

    owner = torch.empty(1, dtype=torch.uint8, device=torch.device("cuda", device))
    shared = owner.untyped_storage()._share_cuda_()
    return owner, shared[4], shared[5]
