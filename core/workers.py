"""A fixed set of worker threads shared fairly by many clients: :class:`FairPool`.

Each client (a stream's decoder and resizer) works through a :class:`Lane` of its own
and hands it parallel loops (``lane.parallel(work, count)``: ``work(0)`` ..
``work(count - 1)``, in any order, on any workers). A free worker takes the next item
of the next lane that has work, round robin, so lanes with work get equal shares of
the workers whatever they asked for, a lane with nothing to do takes nothing (a
stream whose client is slow stops asking), and a lane that starts while another has
the whole pool gets its share from its first item. The number of threads is the
pool's, fixed when it is made: however many lanes there are, no more threads work.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable

__all__ = ["FairPool", "Lane", "Loop", "PoolClosed"]


class PoolClosed(RuntimeError):
    """Work handed to a lane or pool that was closed before it ran."""


class Loop:
    """One ``parallel`` call: ``count`` items of ``work``; :meth:`wait` returns once
    all have run, raising the first exception one of them raised."""

    def __init__(self, work: Callable[[int], None], count: int) -> None:
        self.work = work
        self.count = count
        self.claimed = 0  # items handed to workers (guarded by the pool's lock)
        self.finished = 0
        self.error: BaseException | None = None
        self._done = threading.Event()
        if count == 0:
            self._done.set()

    def wait(self) -> None:
        """Block until every item has run (or, after a close, every item that started).

        Raises:
            BaseException: the first exception an item raised (the others still ran).
            PoolClosed: the lane or pool was closed before every item ran.
        """
        self._done.wait()
        if self.error is not None:
            raise self.error

    def _fail(self, error: BaseException) -> None:
        """Keep ``error`` unless one came first (the pool's lock held)."""
        if self.error is None:
            self.error = error

    def _end(self) -> None:
        self._done.set()


class Lane:
    """A client's queue of loops on a :class:`FairPool` (make it with
    :meth:`FairPool.lane`). ``busy_s`` is the worker time its items have taken."""

    def __init__(self, pool: FairPool, name: str) -> None:
        self.pool = pool
        self.name = name
        self.loops: deque[Loop] = deque()
        self.busy_s = 0.0
        self.closed = False

    def parallel(self, work: Callable[[int], None], count: int, first: bool = False) -> Loop:
        """Schedule ``work(i)`` for ``i`` in ``range(count)``; returns at once.

        ``first``: ahead of this lane's loops not yet started (what its client waits
        on now, such as the resize of the batch it is finishing, goes before the
        decodes it queued for later batches); the other lanes' turns are unchanged.
        """
        return self.pool._schedule(self, Loop(work, count), first)

    def run(self, work: Callable[[int], None], count: int) -> None:
        """``parallel(..., first=True)`` and wait for it: the client is waiting."""
        self.parallel(work, count, first=True).wait()

    def close(self) -> None:
        """Drop the loops not yet started (their waiters get :class:`PoolClosed`)."""
        self.pool._close_lane(self)


class FairPool:
    """``threads`` worker threads, shared round robin by lanes (see the module doc).
    The threads stop when the pool is closed, or collected (with its lanes).

    Args:
        threads: worker threads (at least 1).
        name: prefix of the threads' names.
    """

    def __init__(self, threads: int, name: str = "feeder-decode") -> None:
        self.threads = max(1, threads)
        self._state = _Shared(self.threads)
        for i in range(self.threads):  # the threads hold the shared state, not the pool
            threading.Thread(target=self._state.serve, name=f"{name}_{i}", daemon=True).start()
        weakref.finalize(self, self._state.close)

    def lane(self, name: str = "") -> Lane:
        """A new lane on this pool."""
        return Lane(self, name)

    def close(self) -> None:
        """Stop the workers once the items already claimed have run; loops not
        started end with :class:`PoolClosed`. Idempotent."""
        self._state.close()

    def _schedule(self, lane: Lane, loop: Loop, first: bool) -> Loop:
        return self._state.schedule(lane, loop, first)

    def _close_lane(self, lane: Lane) -> None:
        self._state.close_lane(lane)


class _Shared:
    """What the workers share: the lanes with work, and the lock over every lane's
    loops."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._ready: deque[Lane] = deque()  # lanes with items not yet claimed
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            lanes, self._ready = list(self._ready), deque()
            self._cond.notify_all()
        for lane in lanes:
            self.close_lane(lane)

    def schedule(self, lane: Lane, loop: Loop, first: bool) -> Loop:
        if loop.count == 0:
            return loop
        with self._cond:
            if self._closed or lane.closed:
                loop._fail(PoolClosed(f"lane {lane.name or '?'}: closed"))
                loop._end()
                return loop
            if first:
                lane.loops.appendleft(loop)  # a loop partly claimed goes on after it
            else:
                lane.loops.append(loop)
            if len(lane.loops) == 1:
                self._ready.append(lane)
            self._cond.notify(min(loop.count, self.threads))
        return loop

    def close_lane(self, lane: Lane) -> None:
        """No more items of ``lane`` start; a loop ends once its items already
        running have (with :class:`PoolClosed` when some never ran)."""
        with self._cond:
            lane.closed = True
            if lane in self._ready:
                self._ready.remove(lane)
            loops, lane.loops = list(lane.loops), deque()
            ended = []
            for loop in loops:
                loop._fail(PoolClosed(f"lane {lane.name or '?'}: closed"))
                loop.count = loop.claimed
                if loop.finished == loop.count:
                    ended.append(loop)
        for loop in ended:
            loop._end()

    def _claim(self) -> tuple[Lane, Loop, int] | None:
        """The next item, round robin over the lanes with work (lock held)."""
        while not self._ready:
            if self._closed:
                return None
            self._cond.wait()
        lane = self._ready.popleft()
        loop = lane.loops[0]
        index = loop.claimed
        loop.claimed += 1
        if loop.claimed == loop.count:
            lane.loops.popleft()
        if lane.loops:
            self._ready.append(lane)  # its next item waits for the other lanes' turns
        return lane, loop, index

    def serve(self) -> None:
        """A worker: run items until closed."""
        while True:
            with self._cond:
                claimed = self._claim()
            if claimed is None:
                return
            lane, loop, index = claimed
            started = time.perf_counter()
            error: BaseException | None = None
            try:
                loop.work(index)
            except BaseException as e:  # noqa: BLE001 - handed to the loop's waiter
                error = e
            with self._cond:
                lane.busy_s += time.perf_counter() - started
                if error is not None:
                    loop._fail(error)
                loop.finished += 1
                last = loop.finished == loop.count
            if last:
                loop._end()
            del lane, loop, claimed  # while waiting, hold nothing that keeps a pool alive
