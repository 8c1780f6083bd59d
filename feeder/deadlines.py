"""Deadlines on one thread: each callback runs when its time comes unless it was
cleared first. The daemon bounds waits it cannot interrupt otherwise (a gRPC call
waiting for its request message, an HTTP connection waiting for its header) by
cancelling the call or shutting the socket at the deadline, without a timer thread
per wait."""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["Deadline", "Deadlines"]

_COMPACT_AT = 1024  # cleared deadlines kept before the heap is rebuilt without them


class Deadline:
    """One scheduled callback; ``Deadlines.clear`` takes it back."""

    __slots__ = ("callback", "due_s", "state")

    def __init__(self, due_s: float, callback: Callable[[], None]) -> None:
        self.due_s = due_s
        self.callback = callback
        self.state = "pending"  # then "cleared" or "fired"


class Deadlines:
    """Runs callbacks at their deadlines on one daemon thread, started at the first
    ``add``. Callbacks run under the scheduler's lock, so once ``clear`` has
    returned True the callback has not run and never will: they must be quick
    (cancel a call, shut a socket) and must not call back into the scheduler.

    Args:
        name: the thread's name.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._changed = threading.Condition()
        self._due: list[tuple[float, int, Deadline]] = []
        self._order = itertools.count()
        self._cleared = 0  # cleared deadlines still in ``_due``
        self._thread: threading.Thread | None = None
        self._closed = False

    def add(self, delay_s: float, callback: Callable[[], None]) -> Deadline:
        """Run ``callback`` in ``delay_s`` seconds unless cleared first."""
        deadline = Deadline(time.monotonic() + delay_s, callback)
        with self._changed:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
                self._thread.start()
            heapq.heappush(self._due, (deadline.due_s, next(self._order), deadline))
            if self._due[0][2] is deadline:
                self._changed.notify()
        return deadline

    def clear(self, deadline: Deadline) -> bool:
        """Take ``deadline`` back; False when its callback has already run."""
        with self._changed:
            if deadline.state != "pending":
                return deadline.state == "cleared"
            deadline.state = "cleared"
            self._cleared += 1
            if self._cleared > _COMPACT_AT and 2 * self._cleared > len(self._due):
                self._compact()
            return True

    def _compact(self) -> None:
        """Drop cleared deadlines: most calls clear theirs long before it is due."""
        self._due = [entry for entry in self._due if entry[2].state == "pending"]
        heapq.heapify(self._due)
        self._cleared = 0

    def close(self) -> None:
        """Stop the thread; callbacks still pending never run."""
        with self._changed:
            self._closed = True
            self._changed.notify()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _run(self) -> None:
        with self._changed:
            while not self._closed:
                now = time.monotonic()
                while self._due and (self._due[0][2].state != "pending" or self._due[0][0] <= now):
                    _, _, deadline = heapq.heappop(self._due)
                    if deadline.state == "cleared":
                        self._cleared -= 1
                    else:
                        deadline.state = "fired"
                        self._fire(deadline)
                wait_s = self._due[0][0] - now if self._due else None
                self._changed.wait(timeout=wait_s)

    @staticmethod
    def _fire(deadline: Deadline) -> None:
        try:
            deadline.callback()
        except Exception:  # noqa: BLE001 - one failing callback must not stop the others
            log.exception("deadline callback failed")
