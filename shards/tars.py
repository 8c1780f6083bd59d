"""The tars of a split open for serving: their descriptors, reads that tell the page
cache from the disk, and noticing that a tar changed under its name.

A tar may change while it is served: replaced by another file (``cp`` to a temporary
name and ``mv``, a new inode), or rewritten in place (``dd conv=notrunc``, ``rsync
--inplace``, the same inode). :class:`TarFiles` compares what each path names now
(device, inode, size, modification and change times) with what it opened at most once
per ``recheck_s`` per tar, and at once when a read comes up short or fails its
checksum. A change reopens the tar, counts one more generation of it and calls the
listeners: whoever remembers something about its samples (bad ones) can forget it.
Nothing is trusted because it changed: reads are still checked against the index.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from core.errors import DataError
from shards.beneath import open_beneath

__all__ = ["DEFAULT_RECHECK_S", "FileState", "OpenTar", "TarFiles"]

DEFAULT_RECHECK_S = 1.0  # a served tar's path is looked at again at most this often


class FileState(NamedTuple):
    """What tells a file from another, or from itself before a write: identity
    (device, inode), size and the modification and change times (ns). The change
    time moves on every write, also where the writer puts the old mtime back
    (``rsync -t``)."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int

    @classmethod
    def of(cls, stat: os.stat_result) -> FileState:
        return cls(stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)


class OpenTar:
    """An open tar: its descriptor and the state of the file it was opened as.

    Args:
        path: the file.
        fd: its descriptor, opened already (:func:`shards.beneath.open_beneath`);
            None: ``path`` is opened here.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path, fd: int | None = None) -> None:
        self.fd = os.open(path, os.O_RDONLY) if fd is None else fd
        self.state = FileState.of(os.fstat(self.fd))
        self.next_check = 0.0  # time.monotonic() from which its path is looked at again
        # Reads first try RWF_NOWAIT (Linux): it reads only what is in the page cache,
        # which tells cached reads from disk reads. Off where the file system refuses it.
        self._nowait = getattr(os, "RWF_NOWAIT", 0)

    def read_into(self, buffer: np.ndarray, offset: int) -> tuple[int, bool]:
        """Bytes read into ``buffer`` from ``offset`` (fewer than its size at end of
        file), and whether all of them came from the page cache (False where that is
        unknown)."""
        done, cached = 0, bool(self._nowait)
        if self._nowait:
            try:
                done = os.preadv(self.fd, [buffer.data], offset, self._nowait)
            except BlockingIOError:  # not (all) in the page cache
                pass
            except OSError:  # the file system does not do RWF_NOWAIT
                self._nowait = 0
            cached = done == len(buffer)
        while done < len(buffer):
            count = os.preadv(self.fd, [buffer.data[done:]], offset + done)
            if count == 0:
                break
            done += count
        return done, cached

    def close(self) -> None:
        os.close(self.fd)


class TarFiles:
    """The tars of one split, opened on first use, by their number in ``shards``.
    Thread-safe.

    Args:
        root: the shard directory.
        shards: the tars' paths relative to ``root``.
        recheck_s: the most time between two looks at a served tar's path (0: at
            every read).
        allowed_links: directories outside ``root`` that links in it may lead to;
            every tar is opened beneath ``root`` or one of them
            (:func:`shards.beneath.open_beneath`).
    """

    def __init__(self, root: Path, shards: list[str], recheck_s: float = DEFAULT_RECHECK_S,
                 allowed_links: tuple[Path, ...] = ()) -> None:
        if recheck_s < 0:
            raise ValueError(f"recheck_s must be >= 0, got {recheck_s}")
        self._root, self._shards, self._recheck_s = root, shards, recheck_s
        self._allowed = allowed_links
        self._open: dict[int, OpenTar] = {}
        # Replaced files: other threads may still be reading them; closed with the split.
        self._retired: list[OpenTar] = []
        self._generations = [0] * len(shards)
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        weakref.finalize(self, _close_all, self._open, self._retired)

    def path(self, shard: int) -> Path:
        return self._root / self._shards[shard]

    def get(self, shard: int) -> OpenTar:
        """The open tar ``shard``, looked at again if ``recheck_s`` has passed.

        Raises:
            DataError: it cannot be opened (names it).
        """
        found = self._open.get(shard)
        if found is not None and time.monotonic() < found.next_check:
            return found
        return self.recheck(shard)

    def recheck(self, shard: int) -> OpenTar:
        """The open tar ``shard`` after looking at its path now: reopened (one more
        generation, listeners called) when the path names another file or the file
        changed since it was opened. A path that cannot be looked at or opened keeps
        the file already open: its reads say what is wrong.

        Raises:
            DataError: it was never opened and cannot be (names it).
        """
        with self._lock:
            current = self._open.get(shard)
            if current is None:
                return self._first_open(shard)
            current.next_check = time.monotonic() + self._recheck_s
            try:
                changed = FileState.of(os.stat(self.path(shard))) != current.state
                fresh = self._opened(shard) if changed else current
            except OSError:
                return current
            if fresh is current:
                return current
            fresh.next_check = current.next_check
            self._open[shard] = fresh
            self._retired.append(current)
            self._generations[shard] += 1
            listeners = list(self._listeners)
        for listener in listeners:
            listener(self._shards[shard])
        return fresh

    def _opened(self, shard: int) -> OpenTar:
        """Tar ``shard`` opened beneath the root (or an allowed directory).

        Raises:
            OSError: it cannot be, or it leads elsewhere (:class:`LinkOutside`).
        """
        return OpenTar(self.path(shard), open_beneath(self._root, self._shards[shard], self._allowed))

    def _first_open(self, shard: int) -> OpenTar:
        try:
            opened = self._opened(shard)
        except OSError as e:
            raise DataError(f"{self.path(shard)}: cannot open shard: {e.strerror or e}") from e
        opened.next_check = time.monotonic() + self._recheck_s
        self._open[shard] = opened
        return opened

    def generation(self, shard: int) -> int:
        """How many times tar ``shard`` was found changed and reopened."""
        return self._generations[shard]

    def on_changed(self, listener: Callable[[str], None]) -> None:
        """Call ``listener`` with the tar's path relative to the shard directory each
        time a tar is found changed, in the reading thread, after it is reopened."""
        with self._lock:
            self._listeners.append(listener)


def _close_all(open_files: dict[int, OpenTar], retired: list[OpenTar]) -> None:
    for opened in [*open_files.values(), *retired]:
        opened.close()
