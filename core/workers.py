"""A fixed set of worker threads shared fairly by many clients: :class:`FairPool`.

Each client (a stream's decoder and resizer) works through a :class:`Lane` of its own
and hands it parallel loops (``lane.parallel(work, count)``: ``work(0)`` ..
``work(count - 1)``, in any order, on any workers). The pool shares worker *time*,
not items: each lane has a virtual time, the worker seconds its items took divided by
its weight, and a free worker takes the next item of the lane with work whose virtual
time is least (weighted fair queueing, as Linux's CFS picks the task with the least
``vruntime``). So lanes with work get shares of the workers' time in proportion to
their weights, however long their items take (a 448 px stream's resize costs about 4x
a 224 px one's) and however many they ask for; a lane with nothing to do takes
nothing (a stream whose client is slow stops asking); and a lane that starts while
another has the whole pool gets its share from its first item.

An item is charged when it is claimed, at its lane's mean item time, and corrected
by its measured time when it finishes: a lane with items running on several workers
has paid for them all already. A lane that had no work and gets some is placed at
the least virtual time of the lanes that are busy (the way CFS places a waking task):
time it was away is not owed to it, so it cannot take the pool alone to catch up.
The number of threads is the pool's, fixed when it is made: however many lanes there
are, no more threads work.
"""

from __future__ import annotations

import math
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ConfigError

__all__ = ["FairPool", "Lane", "Loop", "PoolClosed"]

# Share of the latest item in a lane's mean item time (an exponentially weighted
# mean): the charge at claim follows a change of item size within a few items, and
# the measured time corrects each charge anyway.
_MEAN_UPDATE = 0.25


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
    :meth:`FairPool.lane`).

    Attributes:
        busy_s: worker seconds its items have taken (measured by the pool's clock).
        virtual_s: its virtual time: worker seconds charged to it over its weight,
            moved up to the pool's least when it comes back from having no work.
            The lane with work whose ``virtual_s`` is least runs next.
    """

    def __init__(self, pool: FairPool, name: str, weight: float = 1.0) -> None:
        self.pool = pool
        self.name = name
        self.loops: deque[Loop] = deque()
        self.busy_s = 0.0
        self.closed = False
        self.weight = weight
        # Guarded by the pool's lock:
        self.virtual_s = 0.0
        self.running = 0  # items claimed and not finished
        self.item_s: float | None = None  # mean seconds per item; None before its first

    @property
    def weight(self) -> float:
        """Its share: lanes with work get worker time in proportion to their weights
        (1.0 by default; 2.0 gets twice the time of a lane of 1.0 beside it). A new
        weight applies to the items claimed from then on."""
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        if not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"weight: {weight!r} is not a positive number (lane {self.name or '?'})")
        self._weight = float(weight)

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
    """``threads`` worker threads whose time is shared by lanes in proportion to
    their weights (see the module doc). The threads stop when the pool is closed, or
    collected (with its lanes).

    Args:
        threads: worker threads (at least 1).
        name: prefix of the threads' names.
        clock: what an item's time is measured with, in seconds, read on the worker
            before and after the item (``time.perf_counter``: wall time, what the
            item kept a worker from others; a test can count work instead).
    """

    def __init__(self, threads: int, name: str = "feeder-decode",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self.threads = max(1, threads)
        self._state = _Shared(self.threads, clock)
        for i in range(self.threads):  # the threads hold the shared state, not the pool
            threading.Thread(target=self._state.serve, name=f"{name}_{i}", daemon=True).start()
        weakref.finalize(self, self._state.close)

    def lane(self, name: str = "", weight: float = 1.0) -> Lane:
        """A new lane on this pool.

        Raises:
            ConfigError: ``weight`` is not a positive number.
        """
        return Lane(self, name, weight)

    def close(self) -> None:
        """Stop the workers once the items already claimed have run; loops not
        started end with :class:`PoolClosed`. Idempotent."""
        self._state.close()

    def _schedule(self, lane: Lane, loop: Loop, first: bool) -> Loop:
        return self._state.schedule(lane, loop, first)

    def _close_lane(self, lane: Lane) -> None:
        self._state.close_lane(lane)


@dataclass(frozen=True, slots=True)
class _Claimed:
    """An item handed to a worker, and what its lane was charged for it."""

    lane: Lane
    loop: Loop
    index: int
    charged_s: float  # added to the lane's virtual time at the claim
    weight: float  # the lane's weight at the claim


class _Shared:
    """What the workers share: the lanes with work or items running, their virtual
    times, and the lock over every lane's loops."""

    def __init__(self, threads: int, clock: Callable[[], float]) -> None:
        self.threads = threads
        self._clock = clock
        self._ready: list[Lane] = []  # lanes with items not yet claimed, least recently served first
        self._running: set[Lane] = set()  # lanes with items claimed and not finished
        # The least virtual time among busy lanes, as last seen; it never goes back
        # (CFS' min_vruntime): where a lane that comes back with work is placed.
        self._floor_s = 0.0
        self._item_s = 0.0  # mean seconds per item over every lane: the charge of a lane's first
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            lanes, self._ready = list(self._ready), []
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
                self._wake(lane)
            self._cond.notify(min(loop.count, self.threads))
        return loop

    def _wake(self, lane: Lane) -> None:
        """``lane`` has work again (lock held). Back from having nothing queued or
        running, it starts at the busy lanes' least virtual time: no credit for the
        time it was away, so it takes its share, not the pool."""
        if lane.running == 0:
            lane.virtual_s = max(lane.virtual_s, self._advance_floor())
        self._ready.append(lane)

    def _advance_floor(self) -> float:
        """The busy lanes' least virtual time (lock held); the last one seen while
        none is busy."""
        busy = [lane.virtual_s for lane in self._ready]
        busy.extend(lane.virtual_s for lane in self._running)
        if busy:
            self._floor_s = max(self._floor_s, min(busy))
        return self._floor_s

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

    def _claim(self) -> _Claimed | None:
        """The next item: of the lane with work whose virtual time is least, the one
        served longest ago among equals (lock held). Charges the lane its mean item
        time at once."""
        while not self._ready:
            if self._closed:
                return None
            self._cond.wait()
        lane = min(self._ready, key=_virtual_s)
        loop = lane.loops[0]
        index = loop.claimed
        loop.claimed += 1
        if loop.claimed == loop.count:
            lane.loops.popleft()
        self._ready.remove(lane)
        if lane.loops:
            self._ready.append(lane)  # behind the lanes of equal virtual time
        charged_s = (self._item_s if lane.item_s is None else lane.item_s) / lane.weight
        lane.virtual_s += charged_s
        lane.running += 1
        self._running.add(lane)
        return _Claimed(lane, loop, index, charged_s, lane.weight)

    def _finished(self, item: _Claimed, took_s: float) -> None:
        """Book an item's measured time (lock held): its lane's busy time, its
        virtual time corrected from the charge, the mean item times."""
        lane = item.lane
        lane.busy_s += took_s
        lane.virtual_s += took_s / item.weight - item.charged_s
        lane.item_s = took_s if lane.item_s is None else lane.item_s + _MEAN_UPDATE * (took_s - lane.item_s)
        self._item_s += _MEAN_UPDATE * (took_s - self._item_s)
        lane.running -= 1
        if lane.running == 0:
            if not lane.loops:
                self._advance_floor()  # while it still counts: the floor may rise to it
            self._running.discard(lane)

    def serve(self) -> None:
        """A worker: run items until closed."""
        while True:
            with self._cond:
                item = self._claim()
            if item is None:
                return
            started = self._clock()
            error: BaseException | None = None
            try:
                item.loop.work(item.index)
            except BaseException as e:  # noqa: BLE001 - handed to the loop's waiter
                error = e
            took_s = self._clock() - started
            with self._cond:
                self._finished(item, took_s)
                if error is not None:
                    item.loop._fail(error)
                item.loop.finished += 1
                last = item.loop.finished == item.loop.count
            if last:
                item.loop._end()
            del item  # while waiting, hold nothing that keeps a pool alive


def _virtual_s(lane: Lane) -> float:
    return lane.virtual_s
