"""The node-local shard cache: whole copies of remote shards on a local disk, fetched
in the background the first time a shard is read, so later reads of its samples are
local ``pread``s instead of ranged GETs.

Layout of the cache directory (shared by every stream and job of the daemon)::

    lock                 held (flock) by the daemon using it; a second one is refused
    shards/<sha256>.tar  a shard's bytes, named by their sha256 in the manifest
    partial/             downloads under way (``<sha256>.<pid>.part``)

A download is written under ``partial/``, fsynced and renamed into ``shards/``
only once its size and sha256 match the manifest, so a file under ``shards/`` is
always whole: a daemon killed at any moment (SIGKILL, power) leaves at most a file
under ``partial/``, which the next daemon removes before it uses the cache. On start
the cache is checked cheaply: names and sizes (every byte was checked before the
rename, and each read is checked against its sample's checksum anyway: a copy whose
bytes differ from the store's is dropped and the sample read from the store). A shard
of an index without per-sample checksums (versions 1 and 2) has nothing to check its
reads against, so a copy found at start is hashed whole once, in the background,
before it is read (its samples are read from the store meanwhile). A budget smaller
than what is found at start is evicted down to before anything is served.

Past the byte budget, the least recently used shard not being read is evicted; a
shard larger than the whole budget is never cached (its samples are always read with
ranged GETs). Downloads are bounded (``fetch_threads`` at once, each at most
``fetch_bytes_per_s``) so they do not starve the ranged reads the current batches
wait on. A full disk (ENOSPC) stops the cache from growing, with one warning; reads
go on from the store.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from core.errors import ConfigError, FeederError
from shards.layout import fsync_dir

__all__ = ["CacheUsage", "CachedShard", "ShardCache"]

log = logging.getLogger(__name__)

_NAME = re.compile(r"^[0-9a-f]{64}\.tar$")
_TOUCH_EVERY_S = 60.0  # a shard's mtime (its recency across restarts) is brought up at most this often
_FAILED_RETRY_S = 60.0  # a shard whose download failed is not tried again sooner
_CHUNK_BYTES = 16 << 20


@dataclass(frozen=True)
class CachedShard:
    """What the cache knows a remote shard by: the manifest's sha256 and size, its
    URL (for messages), and whether each read of it is checked against its samples'
    checksums (an index of version 3): if not, a copy not made by this process is
    hashed whole before it is read."""

    sha256: str
    size: int
    url: str
    checked: bool = True


class CacheUsage(NamedTuple):
    """The cache's counters (since the daemon started) and what it holds now."""

    hits: int  # samples read from a cached copy
    misses: int  # samples read with ranged GETs
    downloads: int  # shards fetched whole and cached
    download_failures: int
    evictions: int
    cached_shards: int
    cached_bytes: int
    budget_bytes: int


class ShardCache:
    """Whole remote shards in a local directory, within a byte budget.

    Args:
        directory: the cache directory (created).
        budget_bytes: the most bytes of shards kept.
        fetch_threads: shards downloaded at once.
        fetch_bytes_per_s: the most bytes per second each download takes (0: no limit).

    Raises:
        ConfigError: the directory cannot be made or written, or another daemon holds
            it (one line naming it and that daemon's pid).
    """

    def __init__(self, directory: Path, budget_bytes: int, fetch_threads: int = 2, fetch_bytes_per_s: int = 0) -> None:
        if budget_bytes < 0 or fetch_threads < 1 or fetch_bytes_per_s < 0:
            raise ConfigError("cache: budget_bytes and fetch_bytes_per_s must be >= 0, fetch_threads >= 1")
        self.directory, self.budget_bytes = Path(directory), budget_bytes
        self._fetch_bytes_per_s = fetch_bytes_per_s
        # Bytes per request of a download: a quarter second's worth where it is
        # throttled (so the rate is smooth), else large ranges.
        throttled_bytes = min(_CHUNK_BYTES, max(64 << 10, fetch_bytes_per_s // 4))
        self.chunk_bytes = throttled_bytes if fetch_bytes_per_s else _CHUNK_BYTES
        self._stopping = threading.Event()
        self._lock_fd = _take_lock(self.directory)
        self._shards, self._partial = self.directory / "shards", self.directory / "partial"
        self._mutex = threading.Lock()
        self._held: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, least recently used first
        self._pins: dict[str, int] = {}
        self._pending: dict[str, int] = {}  # downloads under way or queued: sha256 -> bytes reserved
        self._failed: dict[str, float] = {}  # sha256 -> when its download failed
        self._touched: dict[str, float] = {}
        self._whole: set[str] = set()  # copies whose every byte this process checked
        self._hashing: set[str] = set()  # copies found at start being checked, for shards without checksums
        self._counts = dict(hits=0, misses=0, downloads=0, download_failures=0, evictions=0)
        self._full_warned = False
        self._load()
        self._fetchers = ThreadPoolExecutor(fetch_threads, thread_name_prefix="feeder-cache-fetch")
        self._closed = False

    def _load(self) -> None:
        """Remove what killed daemons left half-written, and learn what is cached
        (names and sizes), most recently used last."""
        try:
            for directory in (self._shards, self._partial):
                directory.mkdir(parents=True, exist_ok=True)
            for leftover in self._partial.iterdir():
                leftover.unlink()
            found = []
            for entry in os.scandir(self._shards):
                if not _NAME.match(entry.name) or not entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)  # not ours to serve from
                    continue
                found.append((entry.stat().st_mtime, entry.name[:64], entry.stat().st_size))
        except OSError as e:
            raise ConfigError(f"cache_dir {self.directory}: cannot use it ({e.strerror or e})") from e
        for _, sha256, size in sorted(found):
            self._held[sha256] = size
        self._make_room(0)  # a restart with a smaller budget: down to it before anything is served

    def path(self, shard: CachedShard) -> Path:
        return self._shards / f"{shard.sha256}.tar"

    def holds(self, shard: CachedShard) -> bool:
        """Whether a copy of ``shard`` is cached now."""
        with self._mutex:
            return self._held.get(shard.sha256) == shard.size

    @contextmanager
    def reading(self, shard: CachedShard) -> Iterator[Path | None]:
        """The local copy of ``shard`` while the block runs (it is not evicted
        meanwhile), or None when it is not cached."""
        if not self._pin(shard):
            yield None
            return
        try:
            self._touch(shard)
            yield self.path(shard)
        finally:
            with self._mutex:
                self._pins[shard.sha256] -= 1
                if not self._pins[shard.sha256]:
                    del self._pins[shard.sha256]

    def _pin(self, shard: CachedShard) -> bool:
        """Whether ``shard`` is cached; if so it is pinned (not evicted) and most
        recently used."""
        with self._mutex:
            size = self._held.get(shard.sha256)
            if size is None:
                return False
            if size != shard.size:  # another size than the manifest says: not this shard
                self._forget(shard.sha256)
                return False
            if not shard.checked and shard.sha256 not in self._whole:
                if shard.sha256 not in self._hashing and not self._closed:
                    self._hashing.add(shard.sha256)
                    self._fetchers.submit(self._hash_found, shard)
                return False
            self._held.move_to_end(shard.sha256)
            self._pins[shard.sha256] = self._pins.get(shard.sha256, 0) + 1
            return True

    def _touch(self, shard: CachedShard) -> None:
        """Bring the copy's mtime up (its recency after a restart), at most once a minute."""
        now = time.monotonic()
        if now - self._touched.get(shard.sha256, -_TOUCH_EVERY_S) >= _TOUCH_EVERY_S:
            self._touched[shard.sha256] = now
            try:
                os.utime(self.path(shard))
            except OSError:
                pass  # only recency; evicted meanwhile

    def counted(self, hits: int = 0, misses: int = 0) -> None:
        """Samples read from copies (``hits``) and with ranged GETs (``misses``)."""
        with self._mutex:
            self._counts["hits"] += hits
            self._counts["misses"] += misses

    def want(self, shard: CachedShard, chunks: Callable[[], Iterable[memoryview]]) -> None:
        """Fetch ``shard`` in the background (``chunks()``: its bytes in order), unless
        it is cached, on its way, failed lately, larger than the budget, or no room can
        be made for it now."""
        with self._mutex:
            if self._closed or shard.sha256 in self._held or shard.sha256 in self._pending:
                return
            if time.monotonic() - self._failed.get(shard.sha256, -_FAILED_RETRY_S) < _FAILED_RETRY_S:
                return
            if shard.size > self.budget_bytes or not self._make_room(shard.size):
                return
            self._pending[shard.sha256] = shard.size
        self._fetchers.submit(self._fetch, shard, chunks)

    def _make_room(self, size: int) -> bool:
        """Evict least recently used unpinned copies until ``size`` more bytes fit
        (under ``_mutex``); False where they cannot."""
        used = sum(self._held.values()) + sum(self._pending.values())
        victims = []
        for sha256, held in self._held.items():
            if used + size <= self.budget_bytes:
                break
            if sha256 not in self._pins:
                victims.append(sha256)
                used -= held
        if used + size > self.budget_bytes:
            return False
        for sha256 in victims:
            self._forget(sha256)
            self._counts["evictions"] += 1
        return True

    def _forget(self, sha256: str) -> None:
        """Drop a copy (under ``_mutex``); a reader that has it open reads on."""
        self._held.pop(sha256, None)
        self._touched.pop(sha256, None)
        self._whole.discard(sha256)
        (self._shards / f"{sha256}.tar").unlink(missing_ok=True)

    def _hash_found(self, shard: CachedShard) -> None:
        """Check a copy found at start whole, for a shard whose reads nothing checks."""
        digest, size = hashlib.sha256(), 0
        try:
            with open(self.path(shard), "rb") as copy:
                while piece := copy.read(_CHUNK_BYTES):
                    digest.update(piece)
                    size += len(piece)
                    if self._stopping.is_set():
                        return
        except OSError:  # evicted meanwhile
            with self._mutex:
                self._hashing.discard(shard.sha256)
            return
        with self._mutex:
            self._hashing.discard(shard.sha256)
            if size == shard.size and digest.hexdigest() == shard.sha256:
                self._whole.add(shard.sha256)
                return
            self._forget(shard.sha256)
        log.warning("%s: the cached copy %s differs from the manifest's sha256; dropped, read from the store",
                    shard.url, self.path(shard))

    def discard(self, shard: CachedShard) -> None:
        """A read from the copy of ``shard`` failed its checksum: drop the copy."""
        log.warning("%s: the cached copy %s differs from the shard's checksums; dropped, read from the store",
                    shard.url, self.path(shard))
        with self._mutex:
            self._forget(shard.sha256)

    def _fetch(self, shard: CachedShard, chunks: Callable[[], Iterable[memoryview]]) -> None:
        partial = self._partial / f"{shard.sha256}.{os.getpid()}.part"
        try:
            self._write(shard, partial, chunks())
        except FeederError as e:  # the store refused or failed: reads go on with ranged GETs
            self._fetch_failed(shard, partial, f"not cached: {e}")
        except OSError as e:
            full = e.errno in (errno.ENOSPC, errno.EDQUOT)
            self._fetch_failed(shard, partial, None if full else f"not cached: {e.strerror or e}")
            if full:
                self._disk_full(e)
        except Exception as e:  # noqa: BLE001 - anything else: its reservation must not leak
            self._fetch_failed(shard, partial, f"not cached: {type(e).__name__}: {e}")
        else:
            with self._mutex:
                self._pending.pop(shard.sha256, None)
                self._held[shard.sha256] = shard.size
                self._whole.add(shard.sha256)  # hashed as it was written
                self._counts["downloads"] += 1

    def _write(self, shard: CachedShard, partial: Path, chunks: Iterable[memoryview]) -> None:
        """Write ``chunks`` to ``partial``, check them against the manifest and rename
        the file into place (durable first)."""
        digest, written, started = hashlib.sha256(), 0, time.monotonic()
        with open(partial, "wb") as out:
            for chunk in chunks:
                out.write(chunk)
                digest.update(chunk)
                written += len(chunk)
                self._throttle(written, started)
                if self._stopping.is_set():
                    raise OSError(errno.ECANCELED, "the daemon is stopping")
            out.flush()
            os.fsync(out.fileno())
        if written != shard.size or digest.hexdigest() != shard.sha256:
            raise FeederError(f"{written} bytes with sha256 {digest.hexdigest()[:12]}..., the manifest says "
                              f"{shard.size} bytes, {shard.sha256[:12]}...")
        os.rename(partial, self.path(shard))
        fsync_dir(self._shards)

    def _throttle(self, written: int, started: float) -> None:
        if self._fetch_bytes_per_s:
            ahead_s = written / self._fetch_bytes_per_s - (time.monotonic() - started)
            if ahead_s > 0:
                self._stopping.wait(ahead_s)

    def _fetch_failed(self, shard: CachedShard, partial: Path, why: str | None) -> None:
        partial.unlink(missing_ok=True)
        with self._mutex:
            self._pending.pop(shard.sha256, None)
            self._failed[shard.sha256] = time.monotonic()
            self._counts["download_failures"] += 1
        if why is not None and not self._closed:
            log.warning("%s: %s", shard.url, why)

    def _disk_full(self, error: OSError) -> None:
        """The disk is full: the cache keeps what it holds and grows no more."""
        with self._mutex:
            self.budget_bytes = min(self.budget_bytes, sum(self._held.values()) + sum(self._pending.values()))
            warned, self._full_warned = self._full_warned, True
        if not warned:
            log.warning("cache_dir %s is full (%s): the cache keeps its %d bytes and grows no more; samples are "
                        "read from the store", self.directory, error.strerror or error, self.budget_bytes)

    def settle(self, timeout_s: float) -> bool:
        """Wait until no download is under way or queued (at most ``timeout_s``);
        whether none is."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._mutex:
                if not self._pending:
                    return True
            time.sleep(0.02)
        with self._mutex:
            return not self._pending

    def usage(self) -> CacheUsage:
        with self._mutex:
            return CacheUsage(**self._counts, cached_shards=len(self._held), cached_bytes=sum(self._held.values()),
                              budget_bytes=self.budget_bytes)

    def close(self) -> None:
        """Stop downloading (a download under way is abandoned), release the lock."""
        if self._closed:
            return
        self._closed = True
        self._stopping.set()
        self._fetchers.shutdown(wait=True, cancel_futures=True)
        for leftover in self._partial.glob(f"*.{os.getpid()}.part"):
            leftover.unlink(missing_ok=True)
        os.close(self._lock_fd)


def _take_lock(directory: Path) -> int:
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
