"""A stream's queue of ready batches, bounded in batches and in bytes, with the
``put``/``get``/``get_nowait`` of :class:`queue.Queue` so a producer can use either.

The byte bound keeps a few large batches (1024 px x 64 is 200 MB) from holding as
much memory as ``queue_batches`` small ones would suggest. One item is always let in
when the queue is empty, so a batch larger than the byte bound still moves.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque

import numpy as np

__all__ = ["ReadyQueue", "item_bytes"]


def item_bytes(item: object) -> int:
    """Bytes an item holds: its ``images`` array's, 0 for markers and errors."""
    images = getattr(item, "images", None)
    return int(images.nbytes) if isinstance(images, np.ndarray) else 0


class ReadyQueue:
    """FIFO of at most ``max_items`` items and ``max_bytes`` bytes (see module doc).

    Args:
        max_items: bound in items (>= 1).
        max_bytes: bound in bytes, as counted by :func:`item_bytes`.
    """

    def __init__(self, max_items: int, max_bytes: int) -> None:
        self._max_items, self._max_bytes = max_items, max_bytes
        self._items: deque[tuple[object, int]] = deque()
        self._bytes = 0
        self._changed = threading.Condition()

    @property
    def nbytes(self) -> int:
        """Bytes queued now."""
        with self._changed:
            return self._bytes

    def __len__(self) -> int:
        with self._changed:
            return len(self._items)

    def put(self, item: object, timeout: float | None = None) -> None:
        """Append ``item``, waiting up to ``timeout`` seconds for room.

        Raises:
            queue.Full: no room within ``timeout``.
        """
        size = item_bytes(item)
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._fits(size):
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Full
                self._changed.wait(left)
            self._items.append((item, size))
            self._bytes += size
            self._changed.notify_all()

    def get(self, timeout: float | None = None) -> object:
        """Take the oldest item, waiting up to ``timeout`` seconds for one.

        Raises:
            queue.Empty: nothing arrived within ``timeout``.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._changed:
            while not self._items:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise queue.Empty
                self._changed.wait(left)
            item, size = self._items.popleft()
            self._bytes -= size
            self._changed.notify_all()
        return item

    def get_nowait(self) -> object:
        """Take the oldest item now.

        Raises:
            queue.Empty: the queue is empty.
        """
        return self.get(timeout=0)

    def _fits(self, size: int) -> bool:
        if not self._items:
            return True
        return len(self._items) < self._max_items and self._bytes + size <= self._max_bytes
