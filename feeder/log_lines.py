"""What the daemon's log lines may take from clients: names cut to a bounded length
(``clip``), lines about client mistakes rate-limited (``RateLimitedLog``), and a cap
on every line it writes (``LineLimitFilter``), so that no client can fill a disk or
drown the lines that matter."""

from __future__ import annotations

import logging
import threading
import time

__all__ = ["CLIP_CHARS", "DETAIL_CHARS", "LINE_CHARS", "LineLimitFilter", "RateLimitedLog", "clip"]

CLIP_CHARS = 120  # of any client-given name (dataset, split, job id, peer) in a line
DETAIL_CHARS = 600  # of an error message that may hold such names (log line, gRPC status)
LINE_CHARS = 4096  # of any whole line the daemon writes


def clip(text: object, limit: int = CLIP_CHARS) -> str:
    """``str(text)`` with control characters escaped (a client's name cannot start
    a forged log line), cut to ``limit`` characters plus how long it was:
    ``abcd… (1048576 chars)``."""
    whole = str(text)
    shown = whole[:limit + 1]
    if not shown.isprintable():
        shown = shown.encode("unicode_escape").decode("ascii")
    if len(shown) <= limit:
        return shown
    return f"{shown[:limit]}… ({len(whole)} chars)"


class RateLimitedLog:
    """At most ``per_s`` lines a second for each kind of event; the rest are counted
    and reported in one ``suppressed N similar`` line with the next line of that kind
    written, or by ``flush``.

    Args:
        logger: where the lines go.
        per_s: lines per kind per second.
    """

    def __init__(self, logger: logging.Logger, per_s: int = 5) -> None:
        self._logger = logger
        self._per_s = per_s
        self._lock = threading.Lock()
        self._windows: dict[str, tuple[int, int, int]] = {}  # kind -> (second, written, suppressed)

    def warning(self, kind: str, message: str, *args: object) -> None:
        """Log ``message % args`` at WARNING, unless ``kind`` had its lines this second."""
        second = int(time.monotonic())
        with self._lock:
            start, written, suppressed = self._windows.get(kind, (second, 0, 0))
            if start != second:
                written = 0
            if written >= self._per_s:
                self._windows[kind] = (second, written, suppressed + 1)
                return
            self._windows[kind] = (second, written + 1, 0)
        if suppressed and start != second:
            self._logger.warning("%s: suppressed %d similar line(s)", kind, suppressed)
        self._logger.warning(message, *args)

    def flush(self) -> None:
        """Write the ``suppressed`` lines still owed."""
        with self._lock:
            owed = [(kind, s) for kind, (_, _, s) in self._windows.items() if s]
            self._windows.clear()
        for kind, suppressed in owed:
            self._logger.warning("%s: suppressed %d similar line(s)", kind, suppressed)


class LineLimitFilter(logging.Filter):
    """Cuts the message of any record longer than ``limit`` characters, for
    a handler: lines from code that did not ``clip`` what it echoes stay bounded too.

    Args:
        limit: characters a record may have.
    """

    def __init__(self, limit: int = LINE_CHARS) -> None:
        super().__init__()
        self._limit = limit

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if len(message) > self._limit:
            record.msg, record.args = f"{message[:self._limit]}… (line of {len(message)} chars cut)", ()
        return True
