"""Sample bytes of a remote split: ranged GETs, or the node-local copy of a shard
(:mod:`shards.shard_cache`) once it is there.

A batch's samples are grouped by shard and neighbouring ranges merged into one
request (:mod:`shards.requests`); the requests of all streams of a dataset share one
pool of ``max_requests`` threads, so the requests in flight per dataset are bounded
and a slow store of one dataset never holds another dataset's streams. A batch's own
reads go before read-ahead (:meth:`RemoteShards.will_need`, the next batch, fetched
while this one decodes); a read-ahead that failed is never handed to a later read.
Each request has the store's timeout and retries (:mod:`shards.store`). What the
store answers is taken by kind (:class:`~shards.objects.StoreFault`): an object
missing or shorter than the index says is read again for the shard's heal window
(:mod:`shards.troubles`), then comes back as :attr:`Got.refused`, per sample, for the
reader's error policy; credentials refused, or a store unreachable for the whole
retry window, end the stream, naming the URL. While the cache makes a copy of a shard,
the bytes fetched of it land in the copy (the download does not fetch them again) and
samples whose bytes have landed are read from it, where their checksums check them.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError, Future
from dataclasses import dataclass
from typing import Any

import numpy as np

from core.errors import DataError, FeederError
from shards.local_copies import COMING_WAIT_S, FROM_CACHE, LocalCopies
from shards.objects import ObjectMissing, ObjectUrl, StoreFault
from shards.remote_access import RemoteAccess, cache_entries
from shards.requests import AHEAD as _AHEAD
from shards.requests import MAX_REQUEST_BYTES, MERGE_GAP_BYTES, RequestPool, merged_spans
from shards.requests import NEEDED as _NEEDED
from shards.shard_cache import CachedShard, ShardCache
from shards.sources import Extent, Got
from shards.store import ObjectStore
from shards.tars import DEFAULT_RECHECK_S
from shards.troubles import ShardTroubles

__all__ = [
    "MAX_REQUEST_BYTES", "MERGE_GAP_BYTES", "READ_AHEAD_BYTES", "RemoteAccess", "RemoteShards", "RequestPool",
    "cache_entries", "merged_spans",
]

READ_AHEAD_BYTES = 64 << 20  # per remote split: bytes fetched ahead and not read yet
# Where a Got's bytes came from: a cached copy (whole, or being made), the store just
# now, or a read-ahead (fetched a while ago: the object may have changed since).
_FROM_CACHE, _FROM_STORE, _FROM_AHEAD = FROM_CACHE, "store", "ahead"


@dataclass(eq=False)
class _Ahead:
    """A read-ahead request: bytes ``start .. end`` of a shard, and the extents it
    was made for that no read has taken yet (``(offset, end)``); kept until they are
    all taken, or newer read-ahead pushes it past the budget."""

    start: int
    end: int
    future: Future[memoryview]
    left: list[tuple[int, int]]

    def covers(self, extent: Extent) -> bool:
        return _within(extent, self.start, self.end)


class RemoteShards:
    """The tars of one remote split (see the module's docstring).

    Args:
        store: the store, rooted at the shard directory.
        shards: the tars' names relative to it.
        entries: per tar, what the cache knows it by (None: not cacheable, e.g. no
            sha256 in the manifest).
        cache: the node-local shard cache, or None.
        pool: the dataset's request pool.
        heal_s: how long a shard the store fails (missing, or bytes that differ) is
            read again before the failure stands (:mod:`shards.troubles`).
        recheck_s: the most time between two looks at a shard in trouble.
    """

    def __init__(self, store: ObjectStore, shards: list[str], entries: list[CachedShard | None],
                 cache: ShardCache | None, pool: RequestPool, heal_s: float = 0.0,
                 recheck_s: float = DEFAULT_RECHECK_S) -> None:
        self._store, self._shards, self._entries = store, shards, entries
        self._cache, self._pool = cache, pool
        self._copies = LocalCopies(entries, cache, lambda shard: self._fetcher(self._shards[shard]))
        self._ahead: dict[int, list[_Ahead]] = {}
        self._ahead_order: list[tuple[int, _Ahead]] = []
        self._lock = threading.Lock()
        self._troubles = ShardTroubles(heal_s, recheck_s, self._look, lambda shard: self._shards[shard],
                                       lambda shard: str(self.where(shard)))

    def where(self, shard: int) -> ObjectUrl:
        return self._store.url(self._shards[shard])

    def read(self, extents: Sequence[Extent]) -> list[Got]:
        """Each extent's bytes: from the cached copy of its shard, read ahead, or
        fetched now (merged per shard); shards not cached are wanted by the cache."""
        found: list[Got | None] = [None] * len(extents)
        waits: list[tuple[list[int], int, Future[memoryview], bool]] = []
        by_shard: dict[int, list[int]] = {}
        for p, extent in enumerate(extents):
            by_shard.setdefault(extent.shard, []).append(p)
        for shard, positions in by_shard.items():
            if self._copies.read_cached(shard, positions, extents, found):
                continue
            self._copies.want(shard)
            positions = self._copies.read_partial(shard, positions, extents, found)
            fetch = []
            for p in positions:
                ahead = self._take_ahead(extents[p])
                if ahead is None:
                    fetch.append(p)
                else:
                    waits.append(([p], ahead.start, ahead.future, True))
            waits += self._requests(extents, shard, fetch)
        for members, start, future, from_ahead in waits:
            self._fill(extents, members, start, future, found, from_ahead)
        self._heal(extents, found)
        if self._cache is not None:
            self._cache.counted(hits=sum(g is not None and g.token == _FROM_CACHE for g in found),
                                misses=sum(g is not None and g.token in (_FROM_STORE, _FROM_AHEAD) for g in found))
        missing = [p for p, got in enumerate(found) if got is None]
        if missing:
            raise DataError(f"{self.where(extents[missing[0]].shard)}: {len(missing)} samples were not read")
        return [got for got in found if got is not None]

    def _requests(self, extents: Sequence[Extent], shard: int,
                  positions: list[int]) -> list[tuple[list[int], int, Future[memoryview], bool]]:
        """The merged requests that fetch ``extents[p]`` (of ``shard``) for ``positions``, started."""
        return [(span.members, span.start, self._submit(shard, span.start, span.end, _NEEDED), False)
                for span in self._copies.spans(shard, extents, positions)]

    def _heal(self, extents: Sequence[Extent], found: list[Got | None]) -> None:
        """Extents the store said are missing or corrupt, read again while their
        shard's heal window lasts (what a store says is a state of the store: an
        overwrite, a re-upload); the reads that succeeded end a missing shard's trouble."""
        while True:
            for shard in {extents[p].shard for p, got in enumerate(found) if got is not None and got.refused is None}:
                self._troubles.read_ok(shard)
            refused: dict[int, list[int]] = {}
            for p, got in enumerate(found):
                if got is not None and got.fault in (StoreFault.MISSING, StoreFault.CORRUPT):
                    refused.setdefault(extents[p].shard, []).append(p)
            waits = {shard: self._troubles.wait_s(shard, found[ps[0]].fault is StoreFault.MISSING)  # type: ignore
                     for shard, ps in refused.items()}
            due = {shard: ps for shard, ps in refused.items() if waits[shard] > 0}
            if not due:
                return
            if self._store.stopping.wait(max(waits[shard] for shard in due)):
                return
            for shard, positions in due.items():
                for members, start, future, _ in self._requests(extents, shard, positions):
                    self._fill(extents, members, start, future, found)

    def _submit(self, shard: int, start: int, end: int, priority: int,
                store_only: bool = False) -> Future[memoryview]:
        """A request for bytes ``start .. end`` of ``shard``. Where the shard's copy is
        being made, only what has neither landed nor is on its way is fetched, and
        what comes lands in it at once (a read-ahead dropped unread is not fetched
        again by the download); a copy finished meanwhile is read instead.
        ``store_only``: from the store whatever the copies hold (a second look after
        a checksum failure)."""
        fetch = self._fetcher(self._shards[shard])

        def get() -> memoryview:
            copy = None if store_only else self._copies.partial(shard)
            landed = None if copy is None else copy.fill(start, end, fetch, COMING_WAIT_S)
            # A copy finished since the request was made, or since the read found none
            # (its download can end between the two looks a read takes at the copies).
            if landed is None and not store_only:
                landed = self._copies.cached_bytes(shard, start, end)
            return memoryview(landed) if landed is not None else fetch(start, end - start)

        return self._pool.submit(get, priority)

    def _fill(self, extents: Sequence[Extent], members: list[int], start: int, future: Future[memoryview],
              found: list[Got | None], ahead: bool = False) -> None:
        """The extents at ``members`` from the bytes ``future`` brings (from ``start``).
        A read-ahead that failed, in any way, is never handed on: its extents are
        fetched again now.

        Raises:
            ServiceUnavailable: the store did not answer for as long as retries last.
            Unauthenticated, PermissionDenied: the store refused the credentials
                (names the URL): the stream ends.
        """
        try:
            data = future.result()
        except (CancelledError, FeederError) as e:
            if not ahead and not isinstance(e, CancelledError):
                self._refuse(extents, members, found, e)
                return
            # Read-ahead dropped past its budget, or failed (the store may be back): fetch it now.
            span_end = max(extents[p].offset + extents[p].size for p in members)
            future = self._submit(extents[members[0]].shard, start, span_end, _NEEDED)
            self._fill(extents, members, start, future, found)
            return
        token = _FROM_AHEAD if ahead else _FROM_STORE
        for p in members:
            offset, size = extents[p].offset - start, extents[p].size
            if offset + size > len(data):
                found[p] = Got(np.empty(0, np.uint8), 0, token=_FROM_STORE, fault=StoreFault.CORRUPT, refused=(
                    f"the object ends at byte {start + len(data)}, the index says {extents[p].offset + size}"))
            else:
                found[p] = Got(np.frombuffer(data, np.uint8, size, offset).copy(), size, token=token)

    @staticmethod
    def _refuse(extents: Sequence[Extent], members: list[int], found: list[Got | None], error: FeederError) -> None:
        """What the store refused for the extents at ``members``, by kind: missing or
        corrupt goes to the heal window and then the bad-sample policy; anything else
        (unreachable for the whole retry window, credentials refused) ends the stream."""
        if isinstance(error, ObjectMissing):
            fault = StoreFault.MISSING
        elif isinstance(error, DataError):  # shorter than the index says, another permanent answer
            fault = StoreFault.CORRUPT
        else:
            raise error
        for p in members:
            found[p] = Got(np.empty(0, np.uint8), 0, token=_FROM_STORE, refused=_reason(error), fault=fault)

    def _fetcher(self, name: str) -> Callable[[int, int], memoryview]:
        """Bytes (start, length) of object ``name``, fewer where it ends sooner (whoever
        reads them checks their length: :meth:`_fill`, the cache's download)."""
        return lambda start, length: self._store.get_range(name, start, length, exact=False)

    def reread(self, extent: Extent, got: Got) -> Got | None:
        """After bytes failed their checksum: bytes from a cached copy are fetched from
        the store, and the copy dropped only where the store's differ (where they are
        the same, the sample is bad in the store too: the copy is kept, not fetched
        whole again each time the sample is read); bytes read ahead are fetched again
        at once (the object may have been put right since); bytes just fetched from
        the store are fetched again while the shard's heal window lasts (then None: the
        sample is bad, for now)."""
        entry = self._entries[extent.shard]
        if got.token == _FROM_CACHE and self._cache is not None and entry is not None:
            fetched = self._fetch_now(extent)
            same = fetched is not None and fetched.done == got.done and np.array_equal(fetched.data, got.data)
            if fetched is not None and fetched.refused is None and not same:
                self._cache.discard(entry)
            return fetched
        if got.token == _FROM_AHEAD:
            pass  # fetched a while ago: the object may be right again now, fetch it once more at once
        elif got.token == _FROM_STORE:
            wait_s = self._troubles.wait_s(extent.shard, missing=False)
            if wait_s <= 0 or self._store.stopping.wait(wait_s):
                return None
        else:
            return None
        return self._fetch_now(extent)

    def _fetch_now(self, extent: Extent) -> Got | None:
        found: list[Got | None] = [None]
        future = self._submit(extent.shard, extent.offset, extent.offset + extent.size, _NEEDED, store_only=True)
        self._fill([extent], [0], extent.offset, future, found)
        return found[0]

    def generation(self, shard: int) -> int:
        """How many times what the store said of ``shard`` was found over (see
        :mod:`shards.troubles`)."""
        return self._troubles.generation(shard)

    def on_changed(self, listener: Callable[[str], None]) -> None:
        self._troubles.on_over(listener)

    def look_at(self, shard: int) -> None:
        """Look at a shard in trouble again, in the background (its ETag, or whether
        it exists), at most once per ``recheck_s``."""
        self._troubles.looked(shard)

    def _look(self, shard: int) -> Future[str]:
        name = self._shards[shard]

        def etag() -> str:
            try:
                return self._store.head(name, window_s=0).etag or "?"
            except ObjectMissing:
                return ""

        return self._pool.submit(etag, _AHEAD)

    def will_need(self, extents: Sequence[Extent]) -> None:
        """Fetch these extents now, behind the reads batches wait on; kept (at most
        ``READ_AHEAD_BYTES`` per split) until read, then let go. An extent already on
        its way in a kept read-ahead is not fetched again: that one is kept for it too."""
        by_shard: dict[int, list[int]] = {}
        for p, extent in enumerate(extents):
            if not self._copies.has(extent.shard, extent) and not self._ahead_for(extent):
                by_shard.setdefault(extent.shard, []).append(p)
        for shard, positions in by_shard.items():
            self._copies.want(shard)  # before the requests, so their bytes land in its copy
            for span in self._copies.spans(shard, extents, positions):
                left = [(extents[p].offset, extents[p].offset + extents[p].size) for p in span.members]
                future = self._submit(shard, span.start, span.end, _AHEAD)
                self._keep_ahead(shard, _Ahead(span.start, span.end, future, left))

    def _ahead_for(self, extent: Extent) -> bool:
        """Whether a kept read-ahead that has not failed covers ``extent``; if so it is
        kept until ``extent`` is read (once, however often it was asked for)."""
        wanted = (extent.offset, extent.offset + extent.size)
        with self._lock:
            for ahead in self._ahead.get(extent.shard, ()):
                if ahead.covers(extent) and not _failed(ahead.future):
                    if wanted not in ahead.left:
                        ahead.left.append(wanted)
                    return True
        return False

    def _keep_ahead(self, shard: int, ahead: _Ahead) -> None:
        with self._lock:
            self._ahead.setdefault(shard, []).append(ahead)
            self._ahead_order.append((shard, ahead))
            total = sum(a.end - a.start for _, a in self._ahead_order)
            while total > READ_AHEAD_BYTES and len(self._ahead_order) > 1:
                old_shard, old = self._ahead_order.pop(0)
                self._ahead[old_shard].remove(old)
                old.future.cancel()
                total -= old.end - old.start

    def _take_ahead(self, extent: Extent) -> _Ahead | None:
        """The read-ahead request that covers ``extent``, if any. It is let go once
        every extent it was made for has been taken (kept, its bytes would serve later
        epochs' reads from memory while their own read-ahead fetched them again)."""
        with self._lock:
            for ahead in list(self._ahead.get(extent.shard, ())):
                if not ahead.covers(extent):
                    continue
                failed = _failed(ahead.future)  # never handed on (the store may answer now): a later one may do
                taken = next((left for left in ahead.left if _within(extent, *left)), None)
                if taken is not None:
                    ahead.left.remove(taken)
                if failed or not ahead.left:
                    self._ahead[extent.shard].remove(ahead)
                    self._ahead_order.remove((extent.shard, ahead))
                if not failed:
                    return ahead
        return None

    def forget_ahead(self) -> None:
        """Drop every read-ahead request (tests; a split no longer read)."""
        with self._lock:
            for _, ahead in self._ahead_order:
                ahead.future.cancel()
            self._ahead.clear()
            self._ahead_order.clear()


def _within(extent: Extent, start: int, end: int) -> bool:
    """Whether ``extent``'s bytes lie within ``start .. end``."""
    return start <= extent.offset and extent.offset + extent.size <= end


def _failed(future: Future[Any]) -> bool:
    """Whether ``future`` is done and raised (cancelled ones too)."""
    return future.done() and (future.cancelled() or future.exception() is not None)


def _reason(error: FeederError) -> str:
    detail = getattr(error, "detail", None)
    return str(detail) if detail else str(error)
