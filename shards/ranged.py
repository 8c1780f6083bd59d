"""Sample bytes of a remote split: ranged GETs, or the node-local copy of a shard
(:mod:`shards.shard_cache`) once it is there.

A batch's samples are grouped by shard and neighbouring ranges merged into one
request (less than ``MERGE_GAP_BYTES`` apart, at most ``MAX_REQUEST_BYTES`` each);
the requests of all streams of a dataset share one pool of ``max_requests`` threads,
so the requests in flight per dataset are bounded and a slow store of one dataset
never holds another dataset's streams. A batch's own reads go before read-ahead
(:meth:`RemoteShards.will_need`, the next batch, fetched while this one decodes).
Each request has the store's timeout and retries (:mod:`shards.store`); what a store
refuses for good (404, 403, an object shorter than the index says) comes back as
:attr:`Got.refused`, per sample, for the reader's error policy.
"""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

from core.errors import DataError, ServiceUnavailable
from shards.objects import ObjectUrl
from shards.shard_cache import CachedShard, ShardCache
from shards.sources import Extent, Got
from shards.store import ObjectStore, StoreCounters, StoreOptions
from shards.tars import OpenTar

__all__ = [
    "MAX_REQUEST_BYTES", "MERGE_GAP_BYTES", "RemoteAccess", "RemoteShards", "RequestPool", "cache_entries",
    "merged_spans",
]

# Two samples' ranges less than this apart are fetched in one request: the bytes
# between cost less than a request's round trip (about 1.5 ms here, 100 KB at the
# store's 70 MB/s per request).
MERGE_GAP_BYTES = 128 << 10
MAX_REQUEST_BYTES = 8 << 20
_AHEAD_BYTES = 64 << 20  # per split: bytes fetched ahead and not read yet
_NEEDED, _AHEAD = 0, 1  # request priorities
_FROM_CACHE, _FROM_STORE = "cache", "store"


@dataclass(frozen=True)
class RemoteAccess:
    """How a daemon (or a tool) reads remote roots: the store's options, counters
    shared by its datasets, the node-local cache (None: ranged reads only), and the
    requests in flight per dataset."""

    options: StoreOptions = StoreOptions()
    counters: StoreCounters = field(default_factory=StoreCounters)
    cache: ShardCache | None = None
    max_requests: int = 16


class RequestPool:
    """``threads`` threads running requests, lower priority first, then in order.
    One per dataset; its threads end once nothing refers to it (the dataset's splits
    are gone)."""

    def __init__(self, threads: int, name: str) -> None:
        self._queue: queue.PriorityQueue[_Queued] = queue.PriorityQueue()
        self._order = itertools.count()
        for i in range(threads):  # the threads hold the queue, not the pool
            threading.Thread(target=_work, args=(self._queue,), name=f"{name}-{i}", daemon=True).start()
        weakref.finalize(self, _stop, self._queue, threads)

    def submit(self, request: Callable[[], Any], priority: int = _NEEDED) -> Future[Any]:
        future: Future[Any] = Future()
        self._queue.put((priority, next(self._order), future, request))
        return future


_Queued = tuple[int, int, "Future[Any] | None", "Callable[[], Any] | None"]


def _work(requests: queue.PriorityQueue[_Queued]) -> None:
    while True:
        _, _, future, request = requests.get()
        if future is None or request is None:
            return
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(request())
        except BaseException as e:  # handed to whoever waits on the future
            future.set_exception(e)
        del future, request  # while waiting for the next, hold nothing that holds the pool


def _stop(requests: queue.PriorityQueue[_Queued], threads: int) -> None:
    for number in range(threads):
        requests.put((_AHEAD + 1, -1 - number, None, None))  # after every request queued


class Span(NamedTuple):
    start: int
    end: int
    members: list[int]  # positions of the extents it covers


def merged_spans(extents: Sequence[Extent], positions: Sequence[int], gap: int = MERGE_GAP_BYTES,
                 max_bytes: int = MAX_REQUEST_BYTES) -> list[Span]:
    """The requests that fetch ``extents[p]`` for each ``p`` of ``positions`` (one
    shard's): ranges sorted, and merged where less than ``gap`` bytes apart while the
    request stays within ``max_bytes``."""
    spans: list[Span] = []
    for p in sorted(positions, key=lambda p: extents[p].offset):
        start, end = extents[p].offset, extents[p].offset + extents[p].size
        last = spans[-1] if spans else None
        if last is not None and start - last.end < gap and max(end, last.end) - last.start <= max_bytes:
            spans[-1] = Span(last.start, max(end, last.end), [*last.members, p])
        else:
            spans.append(Span(start, end, [p]))
    return spans


def cache_entries(url: ObjectUrl, info: dict[str, Any], shards: list[str]) -> list[CachedShard | None]:
    """Per tar of ``shards``, what the cache knows it by: its sha256 and size from
    the split's manifest entry ``info`` (None for a tar listed without them)."""
    listed = {str(s["path"]): s for s in info.get("shards", []) if isinstance(s, dict)}
    found: list[CachedShard | None] = []
    for shard in shards:
        entry = listed.get(shard, {})
        sha256, size = entry.get("sha256"), entry.get("bytes")
        if isinstance(sha256, str) and len(sha256) == 64 and isinstance(size, int):
            found.append(CachedShard(sha256, size, str(url / shard)))
        else:
            found.append(None)
    return found


class _Ahead(NamedTuple):
    start: int
    end: int
    future: Future[memoryview]


class RemoteShards:
    """The tars of one remote split (see the module's docstring).

    Args:
        store: the store, rooted at the shard directory.
        shards: the tars' names relative to it.
        entries: per tar, what the cache knows it by (None: not cacheable, e.g. no
            sha256 in the manifest).
        cache: the node-local shard cache, or None.
        pool: the dataset's request pool.
    """

    def __init__(self, store: ObjectStore, shards: list[str], entries: list[CachedShard | None],
                 cache: ShardCache | None, pool: RequestPool) -> None:
        self._store, self._shards, self._entries = store, shards, entries
        self._cache, self._pool = cache, pool
        self._ahead: dict[int, list[_Ahead]] = {}
        self._ahead_order: list[tuple[int, _Ahead]] = []
        self._lock = threading.Lock()

    def where(self, shard: int) -> ObjectUrl:
        return self._store.url(self._shards[shard])

    def read(self, extents: Sequence[Extent]) -> list[Got]:
        """Each extent's bytes: from the cached copy of its shard, read ahead, or
        fetched now (merged per shard); shards not cached are wanted by the cache."""
        found: list[Got | None] = [None] * len(extents)
        waits: list[tuple[list[int], int, Future[memoryview]]] = []
        by_shard: dict[int, list[int]] = {}
        for p, extent in enumerate(extents):
            by_shard.setdefault(extent.shard, []).append(p)
        for shard, positions in by_shard.items():
            if self._read_cached(shard, positions, extents, found):
                continue
            self._want(shard)
            fetch = []
            for p in positions:
                ahead = self._take_ahead(extents[p])
                if ahead is None:
                    fetch.append(p)
                else:
                    waits.append(([p], ahead.start, ahead.future))
            for span in merged_spans(extents, fetch):
                waits.append((span.members, span.start, self._submit(shard, span.start, span.end, _NEEDED)))
        for members, start, future in waits:
            self._fill(extents, members, start, future, found)
        if self._cache is not None:
            self._cache.counted(hits=sum(g is not None and g.token == _FROM_CACHE for g in found),
                                misses=sum(g is not None and g.token == _FROM_STORE for g in found))
        missing = [p for p, got in enumerate(found) if got is None]
        if missing:
            raise DataError(f"{self.where(extents[missing[0]].shard)}: {len(missing)} samples were not read")
        return [got for got in found if got is not None]

    def _submit(self, shard: int, start: int, end: int, priority: int) -> Future[memoryview]:
        name = self._shards[shard]
        return self._pool.submit(lambda: self._store.get_range(name, start, end - start, exact=False), priority)

    def _fill(self, extents: Sequence[Extent], members: list[int], start: int, future: Future[memoryview],
              found: list[Got | None]) -> None:
        """The extents at ``members`` from the bytes ``future`` brings (from ``start``).

        Raises:
            ServiceUnavailable: the store did not answer for as long as retries last.
        """
        try:
            data = future.result()
        except CancelledError:  # read-ahead dropped past its budget before it ran: fetch it now
            span_end = max(extents[p].offset + extents[p].size for p in members)
            future = self._submit(extents[members[0]].shard, start, span_end, _NEEDED)
            self._fill(extents, members, start, future, found)
            return
        except ServiceUnavailable:
            raise
        except DataError as e:  # refused for good: missing, denied, short (the reader's policy decides)
            for p in members:
                found[p] = Got(np.empty(0, np.uint8), 0, token=_FROM_STORE, refused=_reason(e))
            return
        except Exception as e:  # a store error of another kind (e.g. a 400): for good as well
            for p in members:
                found[p] = Got(np.empty(0, np.uint8), 0, token=_FROM_STORE, refused=getattr(e, "detail", str(e)))
            return
        for p in members:
            offset, size = extents[p].offset - start, extents[p].size
            if offset + size > len(data):
                found[p] = Got(np.empty(0, np.uint8), 0, token=_FROM_STORE, refused=(
                    f"the object ends at byte {start + len(data)}, the index says {extents[p].offset + size}"))
            else:
                found[p] = Got(np.frombuffer(data, np.uint8, size, offset).copy(), size, token=_FROM_STORE)

    def _read_cached(self, shard: int, positions: list[int], extents: Sequence[Extent],
                     found: list[Got | None]) -> bool:
        """Reads the extents from the cached copy of ``shard``; False when it has none."""
        entry = self._entries[shard]
        if self._cache is None or entry is None:
            return False
        with self._cache.reading(entry) as path:
            if path is None:
                return False
            try:
                opened = OpenTar(path)
            except OSError:
                return False
            try:
                for p in positions:
                    buffer = np.empty(extents[p].size, dtype=np.uint8)
                    done, cached = opened.read_into(buffer, extents[p].offset)
                    found[p] = Got(buffer, done, cached, _FROM_CACHE)
            finally:
                opened.close()
        return True

    def _want(self, shard: int) -> None:
        entry = self._entries[shard]
        if self._cache is not None and entry is not None:
            name, size, chunk = self._shards[shard], entry.size, self._cache.chunk_bytes
            self._cache.want(entry, lambda: self._store.chunks(name, size, chunk))

    def reread(self, extent: Extent, got: Got) -> Got | None:
        """After a copy's bytes failed their checksum: the copy is dropped and the
        extent fetched from the store. Bytes from the store are not fetched again."""
        entry = self._entries[extent.shard]
        if got.token != _FROM_CACHE or self._cache is None or entry is None:
            return None
        self._cache.discard(entry)
        found: list[Got | None] = [None]
        future = self._submit(extent.shard, extent.offset, extent.offset + extent.size, _NEEDED)
        self._fill([extent], [0], extent.offset, future, found)
        return found[0]

    def generation(self, shard: int) -> int:
        return 0  # an object is not watched for changes: every read is checked against the index

    def on_changed(self, listener: Callable[[str], None]) -> None:
        pass

    def look_at(self, shard: int) -> None:
        pass

    def will_need(self, extents: Sequence[Extent]) -> None:
        """Fetch these extents now, behind the reads batches wait on; kept (at most
        ``_AHEAD_BYTES`` per split) until read."""
        by_shard: dict[int, list[int]] = {}
        for p, extent in enumerate(extents):
            if not self._cached(extent.shard):
                by_shard.setdefault(extent.shard, []).append(p)
        for shard, positions in by_shard.items():
            for span in merged_spans(extents, positions):
                self._keep_ahead(shard, _Ahead(span.start, span.end, self._submit(shard, span.start, span.end, _AHEAD)))

    def _cached(self, shard: int) -> bool:
        entry = self._entries[shard]
        return self._cache is not None and entry is not None and self._cache.holds(entry)

    def _keep_ahead(self, shard: int, ahead: _Ahead) -> None:
        with self._lock:
            self._ahead.setdefault(shard, []).append(ahead)
            self._ahead_order.append((shard, ahead))
            total = sum(a.end - a.start for _, a in self._ahead_order)
            while total > _AHEAD_BYTES and len(self._ahead_order) > 1:
                old_shard, old = self._ahead_order.pop(0)
                self._ahead[old_shard].remove(old)
                old.future.cancel()
                total -= old.end - old.start

    def _take_ahead(self, extent: Extent) -> _Ahead | None:
        """The read-ahead request that covers ``extent``, if any (kept, for the other
        extents it covers, until newer read-ahead pushes it past the budget)."""
        with self._lock:
            for ahead in self._ahead.get(extent.shard, ()):
                if ahead.start <= extent.offset and extent.offset + extent.size <= ahead.end:
                    return ahead
        return None

    def forget_ahead(self) -> None:
        """Drop every read-ahead request (tests; a split no longer read)."""
        with self._lock:
            for _, ahead in self._ahead_order:
                ahead.future.cancel()
            self._ahead.clear()
            self._ahead_order.clear()


def _reason(error: DataError) -> str:
    detail = getattr(error, "detail", None)
    return str(detail) if detail else str(error)
