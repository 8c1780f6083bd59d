"""What a client of a :class:`core.workers.FairPool` holds: its :class:`Lane` of
loops, and the :class:`Share` a job's lanes may be grouped in, with their weights
and the virtual times the pool keeps for them under its lock."""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable
from typing import Protocol

from core.errors import ConfigError
from core.work_loops import Loop

__all__ = ["Lane", "Scheduler", "Share"]


class Scheduler(Protocol):
    """What lanes ask of their pool (:class:`core.workers.FairPool`)."""

    @property
    def threads(self) -> int: ...

    def _schedule(self, lane: Lane, loop: Loop, first: bool) -> Loop: ...

    def _close_lane(self, lane: Lane) -> None: ...

    def _move(self, lane: Lane, share: Share) -> None: ...


def _positive(weight: float, what: str) -> float:
    """``weight`` as a float, checked.

    Raises:
        ConfigError: not a positive finite number.
    """
    if not (math.isfinite(weight) and weight > 0):
        raise ConfigError(f"weight: {weight!r} is not a positive number ({what})")
    return float(weight)


class Share:
    """Lanes that share one weight at the pool's top level (make it with
    :meth:`core.workers.FairPool.share`; a lane enters it with :meth:`Lane.join`).

    Attributes:
        virtual_s: its virtual time: worker seconds charged to its lanes over its
            weight, moved up to the pool's least when it comes back from having no
            work. Of the shares with work, the one whose ``virtual_s`` is least runs
            next.
    """

    def __init__(self, pool: Scheduler, name: str, weight: float = 1.0) -> None:
        self.pool = pool
        self.name = name
        self.weight = weight
        # Guarded by the pool's lock:
        self.virtual_s = 0.0
        self.ready: list[Lane] = []  # its lanes with items not yet claimed, least recently served first
        self.running: dict[Lane, int] = {}  # its lanes with items claimed and not finished: how many
        self.floor_s = 0.0  # the least virtual time of its busy lanes, as last seen (never goes back)

    @property
    def weight(self) -> float:
        """Its part of the pool: shares with work get worker time in proportion to
        their weights (1.0 by default). A new weight applies to the items claimed
        from then on."""
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        self._weight = _positive(weight, f"share {self.name or '?'}")


class Lane:
    """A client's queue of loops on a :class:`core.workers.FairPool` (make it with
    :meth:`core.workers.FairPool.lane`).

    Attributes:
        busy_s: worker seconds its items have taken (measured by the pool's clock).
        cpu_s: CPU seconds its items have taken (each worker thread's own CPU time,
            ``time.thread_time``: what the machine gave them, preemption excluded).
        virtual_s: its virtual time within its share: worker seconds charged to it
            over its weight, moved up to the share's least when it comes back from
            having no work. The share's lane with work whose ``virtual_s`` is least
            runs next.
        share: the :class:`Share` it is in (one of its own unless it joined one).
    """

    def __init__(self, pool: Scheduler, name: str, weight: float = 1.0) -> None:
        self.pool = pool
        self.name = name
        self.loops: deque[Loop] = deque()
        self.busy_s = 0.0
        self.cpu_s = 0.0
        self.closed = False
        self._own = self.share = Share(pool, name, weight)
        self.weight = weight
        # Guarded by the pool's lock:
        self.virtual_s = 0.0
        self.running = 0  # items claimed and not finished
        self.item_s: float | None = None  # mean seconds per item; None before its first

    @property
    def weight(self) -> float:
        """Its part of its share: a share's lanes with work get its worker time in
        proportion to their weights (1.0 by default; 2.0 gets twice the time of a lane
        of 1.0 beside it). A lane in a share of its own gives the share its weight. A
        new weight applies to the items claimed from then on."""
        return self._weight

    @weight.setter
    def weight(self, weight: float) -> None:
        self._weight = _positive(weight, f"lane {self.name or '?'}")
        self._own.weight = self._weight

    @property
    def threads(self) -> int:
        """Its pool's worker threads now: at most this many of its items run at once."""
        return self.pool.threads

    def join(self, share: Share | None) -> None:
        """Move into ``share`` (None: back into a share of its own). Its items
        running stay charged to the share they were claimed in; in the new share it
        starts level with the busy lanes there.

        Raises:
            ConfigError: ``share`` is another pool's.
        """
        if share is not None and share.pool is not self.pool:
            raise ConfigError(f"lane {self.name or '?'}: share {share.name or '?'} is another pool's")
        self.pool._move(self, self._own if share is None else share)

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


