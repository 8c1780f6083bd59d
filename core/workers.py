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
The number of threads is the pool's, set when it is made and changed only by
:meth:`FairPool.resize` (the daemon's tuner): however many lanes there are, no more
threads work.

Lanes may be grouped in a :class:`Share` (a job's streams): then the pool shares its
time first among the shares with work, in proportion to the shares' weights, and each
share's time among its own lanes with work, in proportion to theirs (CFS' group
scheduling, one level deep). A share's lanes that have nothing to do take nothing of
it: a job of eight streams, three of them unread, has the time of one share for its
five busy ones. A lane on its own is a share of its own, of the lane's weight.
"""

from __future__ import annotations

import threading
import time
import weakref
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from core.lanes import Lane, Share
from core.work_loops import Loop, PoolClosed

__all__ = ["FairPool", "Lane", "Loop", "PoolClosed", "Share"]

# Share of the latest item in a lane's mean item time (an exponentially weighted
# mean): the charge at claim follows a change of item size within a few items, and
# the measured time corrects each charge anyway.
_MEAN_UPDATE = 0.25


class FairPool:
    """``threads`` worker threads whose time is shared by lanes in proportion to
    their weights, and by groups of lanes in proportion to their shares' weights
    (see the module doc). The threads stop when the pool is closed, or collected
    (with its lanes).

    Args:
        threads: worker threads (at least 1).
        name: prefix of the threads' names.
        clock: what an item's time is measured with, in seconds, read on the worker
            before and after the item (``time.perf_counter``: wall time, what the
            item kept a worker from others; a test can count work instead).
    """

    def __init__(self, threads: int, name: str = "feeder-decode",
                 clock: Callable[[], float] = time.perf_counter) -> None:
        self._state = _Shared(name, clock)
        self._state.resize(threads)
        weakref.finalize(self, self._state.close)

    @property
    def threads(self) -> int:
        """Worker threads now (those told to stop after their item no longer count)."""
        return self._state.threads

    @property
    def busy_s(self) -> float:
        """Seconds the workers have spent on items, all together (items finished)."""
        return self._state.busy_s

    def resize(self, threads: int) -> None:
        """Work on ``threads`` worker threads (at least 1) from now on: new ones start
        at once; those beyond stop once their item in hand has run (none is cut short)."""
        self._state.resize(threads)

    def lane(self, name: str = "", weight: float = 1.0) -> Lane:
        """A new lane on this pool, in a share of its own.

        Raises:
            ConfigError: ``weight`` is not a positive number.
        """
        return Lane(self, name, weight)

    def share(self, name: str = "", weight: float = 1.0) -> Share:
        """A new share of this pool, for lanes to join (:meth:`Lane.join`).

        Raises:
            ConfigError: ``weight`` is not a positive number.
        """
        return Share(self, name, weight)

    def close(self) -> None:
        """Stop the workers once the items already claimed have run; loops not
        started end with :class:`PoolClosed`. Idempotent."""
        self._state.close()

    def _schedule(self, lane: Lane, loop: Loop, first: bool) -> Loop:
        return self._state.schedule(lane, loop, first)

    def _close_lane(self, lane: Lane) -> None:
        self._state.close_lane(lane)

    def _move(self, lane: Lane, share: Share) -> None:
        self._state.move(lane, share)


@dataclass(frozen=True, slots=True)
class _Claimed:
    """An item handed to a worker, what it was charged at the claim (its lane's
    mean item time) and the weights it was charged at."""

    lane: Lane
    share: Share
    loop: Loop
    index: int
    charged_s: float
    lane_weight: float
    share_weight: float


def _raise_floor(floor_s: float, busy: list[float]) -> float:
    """``floor_s`` raised to the least of ``busy`` (virtual times), never lowered."""
    return max(floor_s, min(busy)) if busy else floor_s


class _Shared:
    """What the workers share: the shares with work or items running, their virtual
    times, and the lock over every lane's loops and every share's lanes."""

    def __init__(self, name: str, clock: Callable[[], float]) -> None:
        self.threads = 0
        self._name = name
        self._started = 0  # threads ever started, for their names
        self._retiring = 0  # workers to stop at their next claim (a smaller pool)
        self._clock = clock
        self._ready: list[Share] = []  # shares with a lane with items not yet claimed, least recently served first
        self._running: set[Share] = set()  # shares with items claimed and not finished
        # The least virtual time among busy shares, as last seen; it never goes back
        # (CFS' min_vruntime): where a share that comes back with work is placed.
        self._floor_s = 0.0
        self._item_s = 0.0  # mean seconds per item over every lane: the charge of a lane's first
        self.busy_s = 0.0  # every finished item's time
        self._cond = threading.Condition(threading.Lock())
        self._closed = False

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
            lanes = [lane for share in self._ready for lane in share.ready]  # close_lane takes them off
            self._cond.notify_all()
        for lane in lanes:
            self.close_lane(lane)

    def resize(self, threads: int) -> None:
        with self._cond:
            if self._closed:
                return
            threads = max(1, threads)
            change, self.threads = threads - self.threads, threads
            if change < 0:
                self._retiring, start = self._retiring - change, 0
            else:  # workers told to stop and not stopped yet stay instead of new ones
                kept = min(self._retiring, change)
                self._retiring, start = self._retiring - kept, change - kept
            names = [f"{self._name}_{self._started + i}" for i in range(start)]
            self._started += start
            self._cond.notify_all()
        for name in names:  # the threads hold the shared state, not the pool
            threading.Thread(target=self.serve, name=name, daemon=True).start()

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
        running, it starts at its share's busy lanes' least virtual time, and a
        share back from having no work at the busy shares' least: no credit for the
        time they were away, so they take their part, not the pool."""
        share = lane.share
        if not share.ready:
            if not share.running:
                share.virtual_s = max(share.virtual_s, self._advance_floor())
            self._ready.append(share)
        if lane.running == 0:
            lane.virtual_s = max(lane.virtual_s, self._advance_share_floor(share))
        share.ready.append(lane)

    def _advance_floor(self) -> float:
        """The busy shares' least virtual time (lock held); the last one seen while
        none is busy."""
        busy = [share.virtual_s for share in self._ready]
        busy.extend(share.virtual_s for share in self._running)
        self._floor_s = _raise_floor(self._floor_s, busy)
        return self._floor_s

    @staticmethod
    def _advance_share_floor(share: Share) -> float:
        """``share``'s busy lanes' least virtual time (lock held)."""
        busy = [lane.virtual_s for lane in share.ready]
        busy.extend(lane.virtual_s for lane in share.running)
        share.floor_s = _raise_floor(share.floor_s, busy)
        return share.floor_s

    def _unready(self, lane: Lane) -> bool:
        """Take ``lane`` off its share's ready list, and the share off the pool's
        when that was its last (lock held); whether it was on it."""
        share = lane.share
        if lane not in share.ready:
            return False
        share.ready.remove(lane)
        if not share.ready:
            self._ready.remove(share)
        return True

    def move(self, lane: Lane, share: Share) -> None:
        """Put ``lane`` in ``share``; its work waiting goes with it."""
        with self._cond:
            if lane.share is share:
                return
            queued = self._unready(lane)
            # Its virtual time counted in another share: it starts level here.
            lane.share, lane.virtual_s = share, self._advance_share_floor(share)
            if queued:
                self._wake(lane)

    def close_lane(self, lane: Lane) -> None:
        """No more items of ``lane`` start; a loop ends once its items already
        running have (with :class:`PoolClosed` when some never ran)."""
        with self._cond:
            lane.closed = True
            self._unready(lane)
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
        """The next item: of the share with work whose virtual time is least, of its
        lane with work whose virtual time is least, each the one served longest ago
        among equals (lock held). Charges both their mean item time at once."""
        while not self._ready or self._retiring:
            if self._closed:
                return None
            if self._retiring:  # the pool was made smaller: this worker stops
                self._retiring -= 1
                return None
            self._cond.wait()
        share = min(self._ready, key=_virtual_s)
        lane = min(share.ready, key=_virtual_s)
        loop = lane.loops[0]
        index = loop.claimed
        loop.claimed += 1
        if loop.claimed == loop.count:
            lane.loops.popleft()
        self._unready(lane)
        if lane.loops:  # behind the lanes, and shares, of equal virtual time
            if not share.ready:
                self._ready.append(share)
            share.ready.append(lane)
        item = _Claimed(lane, share, loop, index, self._item_s if lane.item_s is None else lane.item_s,
                        lane.weight, share.weight)
        lane.virtual_s += item.charged_s / item.lane_weight
        share.virtual_s += item.charged_s / item.share_weight
        lane.running += 1
        share.running[lane] = share.running.get(lane, 0) + 1
        self._running.add(share)
        return item

    def _finished(self, item: _Claimed, took_s: float, cpu_s: float) -> None:
        """Book an item's measured time (lock held): its lane's busy and CPU time,
        its lane's and share's virtual times corrected from the charge, the mean
        item times."""
        lane, share = item.lane, item.share
        self.busy_s += took_s
        lane.busy_s += took_s
        lane.cpu_s += cpu_s
        lane.virtual_s += (took_s - item.charged_s) / item.lane_weight
        share.virtual_s += (took_s - item.charged_s) / item.share_weight
        lane.item_s = took_s if lane.item_s is None else lane.item_s + _MEAN_UPDATE * (took_s - lane.item_s)
        self._item_s += _MEAN_UPDATE * (took_s - self._item_s)
        lane.running -= 1
        share.running[lane] -= 1
        if share.running[lane] == 0:
            if lane not in share.ready:
                self._advance_share_floor(share)  # while it still counts: the floor may rise to it
            del share.running[lane]
        if not share.running:
            if not share.ready:
                self._advance_floor()
            self._running.discard(share)

    def serve(self) -> None:
        """A worker: run items until closed."""
        while True:
            with self._cond:
                item = self._claim()
            if item is None:
                return
            started, cpu_started = self._clock(), time.thread_time()
            error: BaseException | None = None
            try:
                item.loop.work(item.index)
            except BaseException as e:  # noqa: BLE001 - handed to the loop's waiter
                error = e
            took_s, cpu_s = self._clock() - started, time.thread_time() - cpu_started
            with self._cond:
                self._finished(item, took_s, cpu_s)
                if error is not None:
                    item.loop._fail(error)
                item.loop.finished += 1
                last = item.loop.finished == item.loop.count
            if last:
                item.loop._end()
            del item  # while waiting, hold nothing that keeps a pool alive


def _virtual_s(entity: Lane | Share) -> float:
    return entity.virtual_s
