"""One call of :meth:`core.workers.Lane.parallel`: a :class:`Loop` of items its
caller waits on, and :class:`PoolClosed`, what it ends with when its lane or pool
closes before its items ran."""

from __future__ import annotations

import threading
from collections.abc import Callable

__all__ = ["Loop", "PoolClosed"]


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
