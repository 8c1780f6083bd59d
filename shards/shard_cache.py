"""The node-local shard cache: whole copies of remote shards on a local disk, made in
the background the first time a shard is read, so later reads of its samples are local
``pread``s instead of ranged GETs.

Layout of the cache directory (shared by every stream and job of the daemon)::

    lock                 held (flock) by the daemon using it; a second one is refused
    shards/<sha256>.tar  a shard's bytes, named by their sha256 in the manifest
    partial/             copies being made (``<sha256>.<pid>.part``)

A copy is assembled under ``partial/`` (:class:`~shards.partial_copy.PartialCopy`):
the ranged reads batches make of a shard meanwhile land in it, and the background
download fetches only what has not landed, so a cold shard's bytes come from the store
once; reads of samples whose bytes have landed are served from it. It is hashed in
order as it is finished, fsynced and renamed into ``shards/`` only once its size and
sha256 match the manifest, so a file under ``shards/`` is always whole: a daemon
killed at any moment (SIGKILL, power) leaves at most a file under ``partial/``, which
the next daemon removes before it uses the cache. On start the cache is checked
cheaply: names and sizes (every byte was checked before the rename, and each read is
checked against its sample's checksum anyway: a copy whose bytes differ from the
store's is dropped and the sample read from the store). A shard of an index without
per-sample checksums (versions 1 and 2) has nothing to check its reads against: a copy
found at start is hashed whole, in the background, before it is read, and its partial
copy serves no reads. A smaller budget than what is found is evicted down to at start.

Admission fits shuffled reads, which touch every shard of a dataset over and over: a
shard is admitted while its bytes fit the budget (reserved when its copy starts); past
it, room is made only by evicting copies no stream has read for ``idle_evict_s`` (the
least recently used first), never a copy in use, so a dataset twice the budget keeps
the half it cached and reads only the rest from the store, instead of evicting one
copy in use for the next and fetching every shard each epoch. A shard larger than the
whole budget is never cached (its samples are always read with ranged GETs).
Downloads are bounded (``fetch_threads`` at once, each at most ``fetch_bytes_per_s``)
so they do not starve the ranged reads the current batches wait on. A full disk
(ENOSPC) stops the cache from growing, with one warning; reads go on from the store.
"""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from core.errors import ConfigError, FeederError
from shards.cache_dir import file_sha256, found_copies, take_lock
from shards.layout import fsync_dir
from shards.partial_copy import PartialCopy

__all__ = ["CacheUsage", "CachedShard", "ShardCache"]

log = logging.getLogger(__name__)

_TOUCH_EVERY_S = 60.0  # a shard's mtime (its recency across restarts) is brought up at most this often
_FAILED_RETRY_S = 60.0  # a shard whose download failed is not tried again sooner
_REFUSED_RETRY_S = 10.0  # a shard refused for want of room is not considered again sooner
_IDLE_EVICT_S = 60.0  # a copy no stream has read for this long may be evicted for another
_CHUNK_BYTES = 4 << 20  # a download's requests: reads wait for one under way rather than fetch its bytes too


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
        idle_evict_s: how long no stream has read a copy before it may be evicted to
            make room for another shard.

    Raises:
        ConfigError: the directory cannot be made or written, or another daemon holds
            it (one line naming it and that daemon's pid).
    """

    def __init__(self, directory: Path, budget_bytes: int, fetch_threads: int = 4, fetch_bytes_per_s: int = 0,
                 idle_evict_s: float = _IDLE_EVICT_S) -> None:
        if budget_bytes < 0 or fetch_threads < 1 or fetch_bytes_per_s < 0 or idle_evict_s < 0:
            raise ConfigError("cache: budget_bytes, fetch_bytes_per_s and idle_evict_s must be >= 0, "
                              "fetch_threads >= 1")
        self.directory, self.budget_bytes, self._idle_evict_s = Path(directory), budget_bytes, idle_evict_s
        # Bytes per request of a download: a quarter second's worth where it is throttled (a smooth rate).
        self._fetch_bytes_per_s, throttled = fetch_bytes_per_s, min(_CHUNK_BYTES, max(64 << 10, fetch_bytes_per_s // 4))
        self.chunk_bytes = throttled if fetch_bytes_per_s else _CHUNK_BYTES
        self._stopping = threading.Event()
        self._lock_fd = take_lock(self.directory)
        self._shards, self._partial = self.directory / "shards", self.directory / "partial"
        self._mutex = threading.Lock()
        self._held: OrderedDict[str, int] = OrderedDict()  # sha256 -> bytes, least recently used first
        self._pins: dict[str, int] = {}
        self._pending: dict[str, int] = {}  # copies being made: sha256 -> bytes reserved
        self._partials: dict[str, PartialCopy] = {}
        self._failed: dict[str, float] = {}  # sha256 -> when its download failed
        self._refused: dict[str, float] = {}  # sha256 -> when no room could be made for it
        self._touched: dict[str, float] = {}
        self._read_at: dict[str, float] = {}  # sha256 -> when a stream last read its copy
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
        for sha256, size in found_copies(self.directory, self._shards, self._partial):
            self._held[sha256] = size
        self._make_room(0, evict_in_use=True)  # a restart with a smaller budget: down to it before anything is served

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
            self._read_at[shard.sha256] = time.monotonic()
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

    def want(self, shard: CachedShard, fetch: Callable[[int, int], memoryview]) -> None:
        """Make a copy of ``shard`` in the background (``fetch(start, length)``: those
        bytes of it from the store), unless it is cached, on its way, failed lately,
        larger than the budget, or no room can be made for it now."""
        now = time.monotonic()
        with self._mutex:
            if self._closed or shard.sha256 in self._held or shard.sha256 in self._pending:
                return
            if now - self._failed.get(shard.sha256, -_FAILED_RETRY_S) < _FAILED_RETRY_S:
                return
            if now - self._refused.get(shard.sha256, -_REFUSED_RETRY_S) < _REFUSED_RETRY_S:
                return
            if shard.size > self.budget_bytes or not self._make_room(shard.size):
                self._refused[shard.sha256] = now
                return
            self._refused.pop(shard.sha256, None)
            self._pending[shard.sha256] = shard.size
            # Made under the mutex: a read that finds the shard on its way finds its copy
            # too, so its bytes land there and are not fetched again by the download.
            failed: OSError | None = None
            try:
                copy = PartialCopy(self._partial / f"{shard.sha256}.{os.getpid()}.part", shard.size)
                self._partials[shard.sha256] = copy
            except OSError as e:
                failed = e
        if failed is not None:
            self._fetch_failed(shard, None, None if _full(failed) else f"not cached: {failed.strerror or failed}")
            if _full(failed):
                self._disk_full(failed)
            return
        self._fetchers.submit(self._fetch, shard, copy, fetch)

    def partial(self, shard: CachedShard) -> PartialCopy | None:
        """The copy of ``shard`` being made, where bytes fetched of it land; None when
        there is none. Its landed bytes may be read only where each read is checked
        (``shard.checked``): the whole is checked only once it is finished."""
        with self._mutex:
            return self._partials.get(shard.sha256)

    def _make_room(self, size: int, evict_in_use: bool = False) -> bool:
        """Evict least recently used copies no stream holds open, and (unless
        ``evict_in_use``) none read in the last ``idle_evict_s``, until ``size`` more
        bytes fit (under ``_mutex``); False where they cannot."""
        used = sum(self._held.values()) + sum(self._pending.values())
        idle_since = time.monotonic() - self._idle_evict_s
        victims = []
        for sha256, held in self._held.items():
            if used + size <= self.budget_bytes:
                break
            if sha256 not in self._pins and (evict_in_use or self._read_at.get(sha256, -math.inf) <= idle_since):
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
        self._read_at.pop(sha256, None)
        self._whole.discard(sha256)
        (self._shards / f"{sha256}.tar").unlink(missing_ok=True)

    def _hash_found(self, shard: CachedShard) -> None:
        """Check a copy found at start whole, for a shard whose reads nothing checks."""
        sha256 = file_sha256(self.path(shard), self._stopping)
        with self._mutex:
            self._hashing.discard(shard.sha256)
            if sha256 is None or self._stopping.is_set():  # evicted meanwhile, or the daemon is stopping
                return
            if sha256 == shard.sha256:
                self._whole.add(shard.sha256)
                return
            self._forget(shard.sha256)
        log.warning("%s: the cached copy %s differs from the manifest's sha256; dropped, read from the store",
                    shard.url, self.path(shard))

    def discard(self, shard: CachedShard) -> None:
        """A read from the copy of ``shard`` (cached, or being made) failed its
        checksum: drop the copy (one being made is abandoned, and made again later)."""
        log.warning("%s: the cached copy %s differs from the shard's checksums; dropped, read from the store",
                    shard.url, self.path(shard))
        with self._mutex:
            self._forget(shard.sha256)
            copy = self._partials.pop(shard.sha256, None)
        if copy is not None:
            copy.failed = OSError(errno.EIO, "a sample read from it failed its checksum")

    def _fetch(self, shard: CachedShard, copy: PartialCopy, fetch: Callable[[int, int], memoryview]) -> None:
        try:
            self._write(shard, copy, fetch)
        except FeederError as e:  # the store refused or failed: reads go on with ranged GETs
            self._fetch_failed(shard, copy, f"not cached: {e}")
        except OSError as e:
            self._fetch_failed(shard, copy, None if _full(e) else f"not cached: {e.strerror or e}")
            if _full(e):
                self._disk_full(e)
        except Exception as e:  # noqa: BLE001 - anything else: its reservation must not leak
            self._fetch_failed(shard, copy, f"not cached: {type(e).__name__}: {e}")

    def _write(self, shard: CachedShard, copy: PartialCopy, fetch: Callable[[int, int], memoryview]) -> None:
        """Fetch what has not landed in ``copy``, check the whole against the manifest
        and rename the file into place (durable first)."""
        started = time.monotonic()

        def paced(fetched: int) -> None:
            self._throttle(fetched, started)
            if self._stopping.is_set():
                raise OSError(errno.ECANCELED, "the daemon is stopping")

        sha256 = copy.complete(fetch, self.chunk_bytes, paced, leads=not self._fetch_bytes_per_s)
        if sha256 != shard.sha256:
            raise FeederError(f"{shard.size} bytes with sha256 {sha256[:12]}..., the manifest says "
                              f"{shard.sha256[:12]}...")
        copy.sync()
        os.rename(copy.path, self.path(shard))  # reads go on from the copy's descriptor until it is held
        with self._mutex:
            self._pending.pop(shard.sha256, None)
            self._partials.pop(shard.sha256, None)
            self._held[shard.sha256] = shard.size
            self._read_at[shard.sha256] = time.monotonic()  # made for a read: in use
            self._whole.add(shard.sha256)  # hashed as it was finished
            self._counts["downloads"] += 1
        copy.close()
        fsync_dir(self._shards)

    def _throttle(self, written: int, started: float) -> None:
        if self._fetch_bytes_per_s:
            ahead_s = written / self._fetch_bytes_per_s - (time.monotonic() - started)
            if ahead_s > 0:
                self._stopping.wait(ahead_s)

    def _fetch_failed(self, shard: CachedShard, copy: PartialCopy | None, why: str | None) -> None:
        with self._mutex:
            self._partials.pop(shard.sha256, None)  # no read starts on it now
        if copy is not None:
            copy.close()
            copy.path.unlink(missing_ok=True)
        if why is not None and not self._closed:
            log.warning("%s: %s", shard.url, why)
        with self._mutex:  # last: a download no longer pending has left nothing behind (see settle)
            self._pending.pop(shard.sha256, None)
            self._failed[shard.sha256] = time.monotonic()
            self._counts["download_failures"] += 1

    def _disk_full(self, error: OSError) -> None:
        """The disk is full: the cache keeps what it holds and grows no more."""
        with self._mutex:
            self.budget_bytes = min(self.budget_bytes, sum(self._held.values()) + sum(self._pending.values()))
            warned, self._full_warned = self._full_warned, True
        if not warned:
            log.warning("cache_dir %s is full (%s): the cache keeps its %d bytes and grows no more; samples are "
                        "read from the store", self.directory, error.strerror or error, self.budget_bytes)

    def settle(self, timeout_s: float) -> bool:
        """Wait until no download is under way or queued (at most ``timeout_s``),
        each one's copy renamed or removed and its failure logged; whether none is."""
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
        with self._mutex:
            copies, self._partials = list(self._partials.values()), {}
        for copy in copies:  # queued, never started
            copy.close()
        for leftover in self._partial.glob(f"*.{os.getpid()}.part"):
            leftover.unlink(missing_ok=True)
        os.close(self._lock_fd)


def _full(error: OSError) -> bool:
    return error.errno in (errno.ENOSPC, errno.EDQUOT)
