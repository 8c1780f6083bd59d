"""The slot bookkeeping of a stream's ring, shared by the shared-memory and the CUDA
IPC transports: which slots are lent, and the generation of each loan.

Each loan of a slot has a generation; a release must name the slot's current one, so
a stale or repeated release is refused instead of freeing a slot that holds another
batch. A ring whose clients can also give slots back without a call (shared memory's
release words) says so with :meth:`SlotRing.reclaim` and a polling interval.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from core.errors import InvalidArgument
from transport.base import TransportClosed

__all__ = ["SlotRing"]


class SlotRing:
    """Loans of ``slots`` slots.

    Args:
        slots: slots in the ring.
        name: the ring's name in messages (the stream's).
        poll_s: how often a waiting :meth:`acquire` calls :meth:`reclaim` (None: it
            waits for a :meth:`release` to wake it).
    """

    def __init__(self, slots: int, name: str, poll_s: float | None = None) -> None:
        if slots < 1:
            raise ValueError(f"ring of {slots} slots")
        self.slots = slots
        self.name = name
        self._poll_s = poll_s
        self._generation = [0] * slots
        self._lent = [False] * slots
        self._free = deque(range(slots))
        self._cond = threading.Condition()
        self.closed = False

    def acquire(self, timeout_s: float | None) -> tuple[int, int] | None:
        """Lends a free slot: ``(index, generation)``, or None after ``timeout_s``
        (None: no limit).

        Raises:
            TransportClosed: the ring was closed meanwhile.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while not self._has_free():
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return None
                self._cond.wait(self._wait_s(left))
            if self.closed:
                raise TransportClosed(f"{self.name}: ring closed")
            index = self._free.popleft()
            self._generation[index] += 1
            self._lent[index] = True
            return index, self._generation[index]

    def _wait_s(self, left: float | None) -> float | None:
        if self._poll_s is None:
            return left
        return self._poll_s if left is None else min(self._poll_s, left)

    def _has_free(self) -> bool:
        """True when closed or a slot is free, after :meth:`reclaim` (lock held)."""
        if self.closed or self._free:
            return True
        for index, lent in enumerate(self._lent):
            if lent and self.reclaim(index, self._generation[index]):
                self._lent[index] = False
                self._free.append(index)
        return bool(self._free)

    def reclaim(self, index: int, generation: int) -> bool:
        """Whether the client gave back loan ``generation`` of slot ``index`` without
        a call (called with the ring's lock held, while a producer waits)."""
        return False

    def release(self, index: int, generation: int) -> None:
        """Takes back the loan ``generation`` of slot ``index``; nothing once closed.

        Raises:
            InvalidArgument: no such slot, not lent, or another loan's generation.
        """
        with self._cond:
            if self.closed:
                return  # the stream is over; nothing left to protect
            where = f"stream {self.name} slot {index}"
            if not 0 <= index < self.slots:
                raise InvalidArgument(f"{where}: no such slot ({self.slots} slots)")
            current = self._generation[index]
            if not self._lent[index] or generation > current:
                raise InvalidArgument(f"{where} generation {generation}: not lent (released twice?)")
            if generation != current:
                raise InvalidArgument(f"{where}: stale generation {generation} (current {current})")
            self._lent[index] = False
            self._free.append(index)
            self._cond.notify()

    def close(self) -> bool:
        """Wakes waiting producers (they raise :class:`TransportClosed`); False when it
        was closed already."""
        with self._cond:
            if self.closed:
                return False
            self.closed = True
            self._cond.notify_all()
            return True
