"""What the open streams, and the jobs they belong to, use of the daemon: decode
threads (worker seconds and CPU seconds) and images sent, reported to
:class:`feeder.metrics.ServerMetrics` about once a second by the daemon's watcher
(:meth:`Usage.tick`) and once more when a stream closes, so a job's counters hold
everything its streams took. A job's labels go when its last stream closes: the
jobs reported are those with a stream open, bounded by ``max_streams``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from feeder.log_lines import clip
from feeder.metrics import ServerMetrics

__all__ = ["Metered", "Usage"]


class Metered(Protocol):
    """What a stream says of its use (:class:`feeder.stream.BatchStream`)."""

    label: str
    samples_sent: int
    starved_s: float

    @property
    def consumer_wait_s(self) -> float: ...

    @property
    def busy_s(self) -> float: ...

    @property
    def cpu_s(self) -> float: ...

    @property
    def queue_fill(self) -> float: ...


@dataclass
class _Booked:
    """A stream's job, and its amounts as last reported."""

    job: str
    busy_s: float = 0.0
    cpu_s: float = 0.0
    images: int = 0


@dataclass
class _Interval:
    """A job's amounts over the interval being reported."""

    streams: int = 0
    busy_s: float = 0.0
    images: int = 0


class Usage:
    """The open streams' and their jobs' use. Thread-safe.

    Args:
        metrics: where it is reported.
        clock: seconds (``time.monotonic``), for the rates over each interval.
    """

    def __init__(self, metrics: ServerMetrics, clock: Callable[[], float] = time.monotonic) -> None:
        self._metrics = metrics
        self._clock = clock
        self._streams: dict[Metered, _Booked] = {}
        self._last_tick_s = clock()
        self._lock = threading.Lock()

    def opened(self, stream: Metered, job: str) -> None:
        """``stream`` of job ``job`` is open (the job's label is the job cut to the
        log's length: a client names it)."""
        with self._lock:
            self._streams[stream] = _Booked(clip(job))

    def closed(self, stream: Metered) -> None:
        """``stream`` closed: what it took since the last tick is booked to its job,
        and the job's labels go with its last stream."""
        with self._lock:
            booked = self._streams.pop(stream, None)
            if booked is None:
                return
            self._book(stream, booked)
            if all(other.job != booked.job for other in self._streams.values()):
                self._metrics.job_gone(booked.job)
        self._metrics.stream_gone(stream.label)

    def tick(self) -> None:
        """Report every open stream's and job's use, and their rates since the
        last tick."""
        with self._lock:
            now = self._clock()
            interval_s, self._last_tick_s = max(now - self._last_tick_s, 1e-6), now
            jobs: dict[str, _Interval] = {}
            for stream, booked in self._streams.items():
                job = jobs.setdefault(booked.job, _Interval())
                busy_s, images = self._book(stream, booked)
                job.streams += 1
                job.busy_s += busy_s
                job.images += images
                self._metrics.stream_usage(stream.label, busy_s / interval_s, stream.queue_fill,
                                           stream.consumer_wait_s, stream.starved_s, booked.cpu_s)
            for name, job in jobs.items():
                self._metrics.job_rates(name, job.streams, job.busy_s / interval_s, job.images / interval_s)

    def _book(self, stream: Metered, booked: _Booked) -> tuple[float, int]:
        """Report what ``stream`` took since it was last booked (lock held); that
        worker time and those images."""
        busy_s, cpu_s, images = stream.busy_s, stream.cpu_s, stream.samples_sent
        took = (busy_s - booked.busy_s, cpu_s - booked.cpu_s, images - booked.images)
        booked.busy_s, booked.cpu_s, booked.images = busy_s, cpu_s, images
        self._metrics.job_used(booked.job, *took)
        return took[0], took[2]
