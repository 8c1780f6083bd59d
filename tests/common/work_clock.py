"""A clock that counts work, not seconds, for checking a :class:`core.workers.FairPool`'s
shares exactly: an item's measured time is the cost it says it has, however loaded
the machine (:class:`WorkClock`); the log of what ran (:class:`WorkLog`); and the
workers held while a test sets its lanes up (:func:`held`), so that they start
together however the machine schedules the test's own thread."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from core.lanes import Lane
from core.workers import FairPool

__all__ = ["WorkClock", "WorkLog", "held"]


class WorkClock:
    """A clock per worker thread that moves only when an item says it worked
    (:meth:`spend`): the pool measures each item at exactly its cost."""

    def __init__(self) -> None:
        self._local = threading.local()

    def __call__(self) -> float:
        return getattr(self._local, "now", 0.0)

    def spend(self, units: float) -> None:
        self._local.now = self() + units


class WorkLog:
    """What ran, in order: (lane name, cost) per item; :meth:`wait` until ``units``
    of work have run."""

    def __init__(self, units: float) -> None:
        self.items: list[tuple[str, float]] = []
        self._lock = threading.Lock()
        self._spent, self._units = 0.0, units
        self._enough = threading.Event()

    def work(self, clock: WorkClock, name: str, cost: float):
        def work(i: int) -> None:
            clock.spend(cost)
            with self._lock:
                self.items.append((name, cost))
                self._spent += cost
                if self._spent >= self._units:
                    self._enough.set()

        return work

    def reached(self) -> None:
        """Until ``units`` of work have run (the lanes go on)."""
        assert self._enough.wait(30)

    def wait(self, lanes: list[Lane]) -> None:
        self.reached()
        for lane in lanes:
            lane.close()

    def shares(self, start: int = 0, units: float | None = None) -> dict[str, float]:
        """Units each lane ran in the first ``units`` of work from item ``start``
        (all of it until ``self.units``)."""
        units = self._units if units is None else units
        spent: dict[str, float] = {}
        for name, cost in self.items[start:]:
            if sum(spent.values()) >= units:
                break
            spent[name] = spent.get(name, 0.0) + cost
        return spent


@contextmanager
def held(pool: FairPool) -> Iterator[None]:
    """Every worker of ``pool`` held on an item of a lane of its own until the block
    ends: the lanes given work inside start level, at the first item, not one after
    another while the pool already runs the first (a test thread held up between two
    lines would leave the first lanes the pool alone meanwhile)."""
    lane, running, gate = pool.lane("held"), threading.Semaphore(0), threading.Event()

    def hold(i: int) -> None:
        running.release()
        assert gate.wait(60)

    loop = lane.parallel(hold, pool.threads)
    try:
        for _ in range(pool.threads):
            assert running.acquire(timeout=60), "a worker never started"
        yield
    finally:
        gate.set()
        loop.wait()
        lane.close()
