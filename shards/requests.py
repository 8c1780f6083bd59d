"""Requests to a store, as a remote split makes them: a batch's samples grouped by
shard and neighbouring ranges merged into one request (:func:`merged_spans`: less
than ``MERGE_GAP_BYTES`` apart, at most ``MAX_REQUEST_BYTES`` each), run by one pool
of threads per dataset (:class:`RequestPool`), a batch's own reads before read-ahead."""

from __future__ import annotations

import itertools
import queue
import threading
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any, NamedTuple

from shards.sources import Extent

__all__ = ["AHEAD", "MAX_REQUEST_BYTES", "MERGE_GAP_BYTES", "NEEDED", "RequestPool", "Span", "merged_spans"]

# Two samples' ranges less than this apart are fetched in one request: the bytes
# between cost less than a request's round trip (about 1.5 ms here, 100 KB at the
# store's 70 MB/s per request).
MERGE_GAP_BYTES = 128 << 10
MAX_REQUEST_BYTES = 8 << 20
NEEDED, AHEAD = 0, 1  # request priorities: what a batch waits on, then read-ahead


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

    def submit(self, request: Callable[[], Any], priority: int = NEEDED) -> Future[Any]:
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
        requests.put((AHEAD + 1, -1 - number, None, None))  # after every request queued


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
