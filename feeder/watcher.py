"""The daemon's one background thread of periodic jobs: each job is a call that
looks at the open streams and acts (cancel the idle, report use, tune, collect the
rings clients let go of), run in turn about once a tick until the watcher closes."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

__all__ = ["Watcher"]


class Watcher:
    """Runs ``jobs`` in order every ``tick_s`` seconds on a thread of its own.

    Args:
        tick_s: seconds between two rounds.
        jobs: the calls of one round, in order.
    """

    def __init__(self, tick_s: float, jobs: Sequence[Callable[[], object]]) -> None:
        self._tick_s = tick_s
        self._jobs = tuple(jobs)
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run, name="feeder-watcher", daemon=True)

    def start(self) -> Watcher:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._closed.wait(self._tick_s):
            for job in self._jobs:
                job()

    def close(self) -> None:
        """No round after the one under way."""
        self._closed.set()
