"""Streams whose client stopped reading, cancelled so that what they hold (memory,
a pipeline, decode threads) goes to the clients that read: after ``idle_timeout_s``
without a batch taken, or ``contended_idle_timeout_s`` while another client was
lately refused for what the open streams hold."""

from __future__ import annotations

from typing import Protocol

from feeder.admission import Admission
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics

__all__ = ["IdleStreams", "Idling"]


class Idling(Protocol):
    """What :class:`IdleStreams` asks of a stream (:class:`feeder.stream.BatchStream`)."""

    def idle_s(self) -> float: ...

    def mark_idle(self, detail: str) -> None: ...

    def close(self) -> None: ...


class IdleStreams:
    """Cancels the open streams left unread.

    Args:
        config: the two timeouts.
        admission: the open streams, and whether the node is contended.
        metrics: where each cancel is counted.
    """

    def __init__(self, config: ServerConfig, admission: Admission, metrics: ServerMetrics) -> None:
        self._idle_s = config.budgets.idle_timeout_s
        self._contended_s = config.budgets.contended_idle_timeout_s
        self._admission = admission
        self._metrics = metrics

    @property
    def tick_s(self) -> float:
        """How often to look: often enough that a stream is cancelled within a
        quarter of its timeout past it, at least once a second."""
        return min(1.0, self._idle_s / 4, self._contended_s / 4)

    def tick(self) -> None:
        """Cancel every open stream unread for longer than the timeout now."""
        timeout_s = min(self._idle_s, self._contended_s) if self._admission.contended() else self._idle_s
        for stream, ticket in self._admission.open():
            idle_s = stream.idle_s()
            if idle_s > timeout_s:
                stream.mark_idle(f"no batch taken for {idle_s:.1f} s (idle timeout {timeout_s:g} s), cancelled")
                self._metrics.stream_idle_cancelled()
                ticket.cancel()
                stream.close()
