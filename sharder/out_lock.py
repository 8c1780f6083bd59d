"""One ``feeder shard`` run at a time into an OUT: ``OUT/.feeder-shard.lock``, held with
``flock`` for the whole run and holding the run's pid, host and start time.

A second run into the same OUT is refused at once, naming the first (with or without
``--overwrite``: two writers of one OUT would each replace the other's files). The
kernel drops a ``flock`` when its holder dies, so the lock file left by a killed run
is taken over silently by the next. The file is removed when the run ends, so a
finished OUT holds no trace of it.

Worker processes are forked (:func:`sharder.normalise.worker_pool`) and would inherit
the lock's descriptor, keeping the lock held after a killed run for as long as they
outlive it: each forked child closes it first (``os.register_at_fork``).
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from contextlib import suppress
from pathlib import Path
from types import TracebackType

from core.errors import ConfigError, os_error_reason

__all__ = ["LOCK_NAME", "OutLock"]

log = logging.getLogger(__name__)

LOCK_NAME = ".feeder-shard.lock"
# File systems that keep no locks (some FUSE and network mounts) say so with these.
_NO_LOCKS = {errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}

# Descriptors of the locks this process holds, closed in every forked child. Module
# state because a fork hook cannot be removed again: it is installed once, below.
_HELD: set[int] = set()


def _close_held_in_child() -> None:
    for fd in _HELD:
        with suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


def _holder(fd: int) -> str:
    """``pid 1234 (started 2025-01-31 12:00:00)`` from the lock file open as ``fd``
    (with its host where that is not this one); ``another run`` if it cannot be read
    (the holder may be writing it this instant)."""
    try:
        owner = json.loads(os.pread(fd, 4096, 0))
        pid, host, started = int(owner["pid"]), str(owner["host"]), str(owner["started"])
    except (OSError, ValueError, KeyError, TypeError):
        return "another run"
    where = f" on {host}" if host != socket.gethostname() else ""
    return f"pid {pid}{where} (started {started})"


def _write_owner(fd: int) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S")}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(owner).encode("utf-8") + b"\n", 0)


def _same_file(fd: int, path: Path) -> bool:
    """The lock file ``fd`` is still the one at ``path`` (not removed by a run that
    ended while this one opened it)."""
    try:
        now = os.stat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (now.st_dev, now.st_ino)


class OutLock:
    """The lock of one OUT for a run, as a context manager: entering creates OUT if
    need be and takes the lock; leaving removes the lock file, and OUT again if
    entering created it and nothing was written into it.

    Args:
        out: the run's OUT.
    """

    def __init__(self, out: Path) -> None:
        self.out = Path(out)
        self.path = self.out / LOCK_NAME
        self._fd: int | None = None
        self._created: list[Path] = []

    def __enter__(self) -> OutLock:
        """Take the lock.

        Raises:
            ConfigError: another run holds it (names its pid and start), or OUT
                cannot be created or written.
        """
        self._created = self._missing_folders()
        try:
            self.out.mkdir(parents=True, exist_ok=True)
            self._fd = self._take()
        except OSError as e:
            self._remove_created()
            raise ConfigError(f"cannot write to OUT {self.out}: {os_error_reason(e)}") from e
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if self._fd is not None:
            with suppress(OSError):
                self.path.unlink()
            _HELD.discard(self._fd)
            os.close(self._fd)  # releases the lock, after the file is gone
            self._fd = None
        self._remove_created()

    def _missing_folders(self) -> list[Path]:
        """OUT and those of its parents that do not exist, OUT first."""
        missing = []
        for folder in (self.out, *self.out.parents):
            if folder.exists():
                break
            missing.append(folder)
        return missing

    def _remove_created(self) -> None:
        for folder in self._created:
            try:
                folder.rmdir()
            except OSError:
                break  # not empty: the run wrote into it
        self._created = []

    def _take(self) -> int:
        """The descriptor of the lock file, locked, with this run written into it."""
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._lock(fd)
                if _same_file(fd, self.path):
                    _write_owner(fd)
                    _HELD.add(fd)
                    return fd
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed meanwhile by the run that held it: open the new one

    def _lock(self, fd: int) -> None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as e:
            raise ConfigError(f"OUT {self.out} is being sharded by {_holder(fd)}") from e
        except OSError as e:
            if e.errno not in _NO_LOCKS:
                raise
            log.warning("OUT %s cannot be locked (%s): nothing stops a second run into it", self.out, e.strerror)
