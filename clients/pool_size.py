"""How many daemons of a pool one stream draws from: ``all`` takes every usable one;
``as-needed`` starts on one (or where the loader's last stream ended) and takes one
more while the consumer waits for batches more than 2 % of its time over a window of
``WINDOW_S``, one fewer while it waits less than 0.5 %. The window after each change
only settles (its wait is the new streams' first batches, not the pool's capacity) and
decides nothing: without it, a pool that had just dropped a daemon saw the new
streams' start as a shortage and took it back, over and over."""

from __future__ import annotations

import logging
import time

__all__ = ["WINDOW_S", "PoolSizer", "WaitWindow"]

_log = logging.getLogger(__name__)
_GROW_ABOVE, _SHRINK_BELOW = 0.02, 0.005  # share of the consumer's time spent waiting
WINDOW_S = 5.0  # over which that share is measured, and the least time between two changes


class WaitWindow:
    """The share of wall time a consumer spent waiting, over windows of ``WINDOW_S``."""

    def __init__(self) -> None:
        self.restart()
        self.last: float | None = None  # the last full window's share

    def restart(self) -> None:
        """Start a new window now (what was counted is forgotten)."""
        self._started, self._waited = time.monotonic(), 0.0

    def add(self, waited_s: float) -> float | None:
        """Count ``waited_s``; the share of the window just completed, if one did."""
        self._waited += waited_s
        now = time.monotonic()
        if now - self._started < WINDOW_S:
            return None
        self.last = self._waited / (now - self._started)
        self._started, self._waited = now, 0.0
        return self.last


class PoolSizer:
    """The count of daemons one stream draws from, under the loader's ``pool`` mode."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self._window = WaitWindow()
        self._settling = True  # the window under way follows a change

    def first(self, usable: int) -> int:
        """Daemons a stream starts on when the loader has no count of its own yet."""
        return 1 if self.mode == "as-needed" else max(1, usable)

    def wanted(self, in_use: int, usable: int) -> int:
        """Daemons to draw from after the pool changed: ``as-needed`` keeps its count
        (as far as the usable ones go), ``all`` takes every usable one."""
        if self.mode == "as-needed":
            return max(1, min(in_use, usable))
        return max(1, usable)

    def changed(self) -> None:
        """The shares were drawn afresh: the next window starts now, and only settles."""
        self._window.restart()
        self._settling = True

    def after_wait(self, waited_s: float, in_use: int, usable: int) -> int:
        """Daemons to draw from after the consumer waited ``waited_s`` for a batch."""
        share = self._window.add(waited_s)
        if self.mode != "as-needed" or share is None:
            return in_use
        if self._settling:
            self._settling = False
            return in_use
        if share > _GROW_ABOVE and in_use < usable:
            _log.info("waiting %.1f %% of the time on %d daemon(s): one more", 100 * share, in_use)
            return in_use + 1
        if share < _SHRINK_BELOW and in_use > 1:
            _log.info("waiting %.2f %% of the time on %d daemons: one fewer", 100 * share, in_use)
            return in_use - 1
        return in_use
