"""The node cache's copies of one remote split's shards, as its reads see them: a
whole cached copy to read samples from, a copy being made (:mod:`shards.partial_copy`)
whose landed bytes serve reads and into which fetched bytes land, and how a request
for a shard being copied is shaped (widened over the tar headers around it, merged
only across small gaps).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager

import numpy as np

from shards.partial_copy import THROUGH_BYTES, PartialCopy
from shards.requests import MERGE_GAP_BYTES, Span, merged_spans
from shards.shard_cache import CachedShard, ShardCache
from shards.sources import Extent, Got
from shards.tars import OpenTar

__all__ = ["COMING_WAIT_S", "FROM_CACHE", "LocalCopies"]

FROM_CACHE = "cache"  # a Got's token: read from a cached copy, whole or being made
# Bytes fetched on each side of a request for a shard whose copy is being made: the
# tar headers and label members between samples (about 1.5 KiB), so the download
# finds no small gaps left between the samples batches read.
_MARGIN_BYTES = 2048
# The longest a read waits for bytes the shard's download is fetching or will fetch
# next (a 64 MiB shard takes about 0.1-0.3 s), rather than fetch them too.
COMING_WAIT_S = 1.0


class LocalCopies:
    """The copies of a split's shards.

    Args:
        entries: per shard, what the cache knows it by (None: not cacheable).
        cache: the node-local shard cache, or None.
        fetcher: per shard, a function of (start, length) that fetches its bytes.
    """

    def __init__(self, entries: list[CachedShard | None], cache: ShardCache | None,
                 fetcher: Callable[[int], Callable[[int, int], memoryview]]) -> None:
        self._entries, self._cache, self._fetcher = entries, cache, fetcher

    def partial(self, shard: int) -> PartialCopy | None:
        """The shard's copy being made (None where there is none, or it failed)."""
        entry = self._entries[shard]
        copy = None if self._cache is None or entry is None else self._cache.partial(entry)
        return copy if copy is not None and copy.failed is None else None

    def holds(self, shard: int) -> bool:
        """Whether a whole copy of the shard is cached now."""
        entry = self._entries[shard]
        return self._cache is not None and entry is not None and self._cache.holds(entry)

    def want(self, shard: int) -> None:
        """The cache is to copy the shard (see :meth:`ShardCache.want`)."""
        entry = self._entries[shard]
        if self._cache is not None and entry is not None:
            self._cache.want(entry, self._fetcher(shard))

    def has(self, shard: int, extent: Extent) -> bool:
        """Whether the extent's bytes are here: in a whole copy, or landed in one being made."""
        copy = self.partial(shard)
        return self.holds(shard) or (copy is not None and copy.has(extent.offset, extent.offset + extent.size))

    def spans(self, shard: int, extents: Sequence[Extent], positions: list[int]) -> list[Span]:
        """The merged requests for ``extents[p]`` of ``shard``: where its copy is being
        made, merged only across small gaps (the bytes between may have landed) and
        widened over the tar headers around them (:meth:`widened`)."""
        if self.partial(shard) is None:
            return merged_spans(extents, positions, MERGE_GAP_BYTES)
        return [Span(*self.widened(shard, span.start, span.end), span.members)
                for span in merged_spans(extents, positions, THROUGH_BYTES)]

    def widened(self, shard: int, start: int, end: int) -> tuple[int, int]:
        """``start .. end``, with up to ``_MARGIN_BYTES`` more on each side that have
        not landed, where the shard's copy is being made (they land in it too)."""
        entry, copy = self._entries[shard], self.partial(shard)
        if copy is None or entry is None:
            return start, end
        before = copy.gaps(max(0, start - _MARGIN_BYTES), start)
        after = copy.gaps(end, min(entry.size, end + _MARGIN_BYTES))
        return before[0][0] if before else start, after[-1][1] if after else end

    def read_cached(self, shard: int, positions: list[int], extents: Sequence[Extent],
                    found: list[Got | None]) -> bool:
        """Reads the extents from the cached copy of ``shard``; False when it has none."""
        with self._opened(shard) as opened:
            if opened is None:
                return False
            for p in positions:
                buffer = np.empty(extents[p].size, dtype=np.uint8)
                done, cached = opened.read_into(buffer, extents[p].offset)
                found[p] = Got(buffer, done, cached, FROM_CACHE)
        return True

    def read_partial(self, shard: int, positions: list[int], extents: Sequence[Extent],
                      found: list[Got | None]) -> list[int]:
        """Reads the extents whose bytes have landed in the shard's copy being made
        (only where checksums check each read); returns the positions left."""
        entry, copy = self._entries[shard], self.partial(shard)
        if copy is None or entry is None or not entry.checked:
            return positions
        left, deadline = [], time.monotonic() + COMING_WAIT_S
        for p in positions:
            buffer = np.empty(extents[p].size, dtype=np.uint8)
            if copy.read_into(buffer, extents[p].offset, max(0.0, deadline - time.monotonic())):
                found[p] = Got(buffer, extents[p].size, True, FROM_CACHE)
            else:
                left.append(p)
        return left

    def cached_bytes(self, shard: int, start: int, end: int) -> bytes | None:
        """Bytes ``start .. end`` of the shard's cached copy; None when it has none."""
        with self._opened(shard) as opened:
            if opened is None:
                return None
            buffer = np.empty(end - start, dtype=np.uint8)
            done, _ = opened.read_into(buffer, start)
            return buffer[:done].tobytes()

    @contextmanager
    def _opened(self, shard: int) -> Iterator[OpenTar | None]:
        """The shard's cached copy, open (and not evicted) while the block runs; None
        when it has none."""
        entry = self._entries[shard]
        if self._cache is None or entry is None:
            yield None
            return
        with self._cache.reading(entry) as path:
            try:
                opened = None if path is None else OpenTar(path)
            except OSError:
                opened = None
            try:
                yield opened
            finally:
                if opened is not None:
                    opened.close()
