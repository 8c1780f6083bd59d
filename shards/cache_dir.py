"""The node cache's directory as a daemon finds it: the lock that makes it one
daemon's, and the copies a previous daemon left (what it left half-written removed).
The layout is in :mod:`shards.shard_cache`."""

from __future__ import annotations

import fcntl
import hashlib
import os
import re
import threading
from pathlib import Path

from core.errors import ConfigError

__all__ = ["file_sha256", "found_copies", "take_lock"]

_NAME = re.compile(r"^[0-9a-f]{64}\.tar$")


def found_copies(directory: Path, shards: Path, partial: Path) -> list[tuple[str, int]]:
    """The copies under ``shards`` as (sha256, size), least recently used first, once
    what killed daemons left under ``partial`` and anything not named as a copy is
    removed.

    Raises:
        ConfigError: the directories cannot be made or read (naming ``directory``).
    """
    try:
        for each in (shards, partial):
            each.mkdir(parents=True, exist_ok=True)
        for leftover in partial.iterdir():
            leftover.unlink()
        found = []
        for entry in os.scandir(shards):
            if not _NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                os.unlink(entry.path)  # not ours to serve from
                continue
            found.append((entry.stat().st_mtime, entry.name[:64], entry.stat().st_size))
    except OSError as e:
        raise ConfigError(f"cache_dir {directory}: cannot use it ({e.strerror or e})") from e
    return [(sha256, size) for _, sha256, size in sorted(found)]


def file_sha256(path: Path, stopping: threading.Event, chunk_bytes: int = 16 << 20) -> str | None:
    """The sha256 of the file at ``path``; None where it cannot be read (evicted
    meanwhile) or ``stopping`` was set before the end."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as copy:
            while piece := copy.read(chunk_bytes):
                digest.update(piece)
                if stopping.is_set():
                    return None
    except OSError:
        return None
    return digest.hexdigest()


def take_lock(directory: Path) -> int:
    """An open descriptor holding ``directory/lock`` exclusively (with this pid in it).

    Raises:
        ConfigError: another process holds it, or the directory cannot be used.
    """
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(directory / "lock", os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ConfigError(f"cache_dir {directory}: cannot use it ({e.strerror or e})") from e
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or "unknown"
        os.close(fd)
        raise ConfigError(f"cache_dir {directory}: in use by another feeder daemon (pid {holder}); "
                          "give each daemon its own --cache-dir") from e
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode("ascii"), 0)
    return fd
