"""Who owns a daemon's unix socket: whoever holds the lock file beside it.

gRPC unlinks whatever is at a socket path before it binds there, a live daemon's
socket too, so a look for a listener before binding cannot stop two daemons starting
at once from both binding one path (each then serves part of the node's ranks). A
daemon therefore takes ``PATH.lock`` (``flock``, exclusive) before it looks at or
binds ``PATH``, and holds it until it has stopped: a second daemon finds the lock
taken and stops with one line. A daemon killed outright leaves its socket file and
its lock file; the kernel drops the lock with the process, so the next claim, or a
sweep, finds nobody holding it and removes what is left.

Light to import (no gRPC): the launcher's guard process sweeps with it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
from pathlib import Path

from core.errors import ConfigError

__all__ = ["LOCK_SUFFIX", "SocketClaim", "answers", "lock_path", "sweep_socket"]

LOCK_SUFFIX = ".lock"
_PROBE_TIMEOUT_S = 2.0  # a live daemon accepts at once; this only bounds a wedged one


def lock_path(path: Path) -> Path:
    """The lock file that says who owns the socket ``path``."""
    return path.with_name(path.name + LOCK_SUFFIX)


def answers(path: Path) -> bool:
    """True when something listens on the unix socket ``path`` (a connection is
    accepted); False when nothing does (refused: a socket left by a daemon that died).

    Raises:
        ConfigError: the socket cannot be probed (another user's, say).
    """
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(_PROBE_TIMEOUT_S)
        try:
            probe.connect(str(path))
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError as e:
            raise ConfigError(f"socket_path: {path} exists and cannot be checked ({e.strerror or e})") from e
    return True


class SocketClaim:
    """The exclusive claim on the unix socket ``path``, held until :meth:`release`
    (or until the process ends, however it ends)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self._fd: int | None = fd

    @classmethod
    def take(cls, path: Path) -> SocketClaim | None:
        """The claim on ``path``; None while another process (or another claim of this
        one) holds it.

        Raises:
            ConfigError: the lock file cannot be made or locked (names it and why).
        """
        lock = lock_path(Path(path))
        while True:
            try:
                fd = os.open(lock, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
            except OSError as e:
                raise ConfigError(f"socket_path: cannot make its lock file {lock} ({e.strerror})") from e
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    return None
                raise ConfigError(f"socket_path: cannot lock {lock} ({e.strerror})") from e
            if _still_named(fd, lock):
                return cls(Path(path), fd)
            os.close(fd)  # its owner removed it between our open and our lock: take the new one

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self, remove_socket: bool = True) -> None:
        """Give the claim up: the socket file first (``remove_socket``; nobody else
        can have bound it while the claim was held), then the lock file, then the
        lock itself. Idempotent."""
        if self._fd is None:
            return
        if remove_socket:
            _remove_socket(self.path)
        try:
            os.unlink(lock_path(self.path))
        except OSError:
            pass  # gone already, or in a sticky directory under another owner's name
        os.close(self._fd)
        self._fd = None


def _still_named(fd: int, lock: Path) -> bool:
    """Whether ``lock`` still names the file open as ``fd`` (a releasing owner removes
    it while it holds the lock, so a claim locked on the removed file is no claim)."""
    try:
        named = os.stat(lock, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (named.st_dev, named.st_ino) == (mine.st_dev, mine.st_ino)


def _remove_socket(path: Path) -> bool:
    """Remove the socket file at ``path`` (never another kind of file); whether one was there."""
    try:
        if not stat.S_ISSOCK(path.lstat().st_mode):
            return False
        path.unlink()
    except FileNotFoundError:
        return False
    return True


def sweep_socket(path: Path) -> bool:
    """Remove what a daemon killed outright left at ``path``: its socket file, when
    nobody holds the socket's claim and nothing answers on it, and the lock file.
    Whether a socket file was removed; a live daemon's socket is left alone."""
    claim = SocketClaim.take(Path(path))
    if claim is None:
        return False
    try:
        removed = not answers(claim.path) and _remove_socket(claim.path)
    except ConfigError:
        removed = False
    claim.release(remove_socket=False)
    return removed
