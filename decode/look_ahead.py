"""Slow samples decoded ahead of their batches, at a steady rate: :class:`LookAhead`.

A batch is ready when its slowest window is decoded, and a window's cost is about its
area in the source's pixels (the window decoder entropy-decodes only the restart
intervals it covers): a window of a 12 MP photo costs about fifteen of an
ImageNet-sized one. A batch that has one waits for it, and with a few in a row the
decode workers run out of other batches to work on. So while slow windows come
(:attr:`LookAhead.wanted`: one seen in the last ``QUIET_BATCHES`` batches), the
runner shows the look-ahead the batches after those in flight (:meth:`LookAhead.add`),
each window's area known before anything is decoded (the crop windows are drawn from
the index's sizes). A window far larger than its batch's others (``factor`` times
their median) is *slow*: it goes on a backlog, and each time a run starts
(:meth:`LookAhead.tick`) the backlog's oldest windows are submitted, about as much
area as slow windows arrive per batch on average (a token bucket, a quarter faster
than they arrive so the backlog keeps up). Their work is spread over the runs, not
piled on the batch they belong to, and each batch's wait is about the same. A run
that starts takes its windows decoded early (:meth:`LookAhead.take`); those not
submitted by then are decoded with the rest of its batch, as without a look-ahead.
Batches are delivered in plan order, exactly as before: only when a window's decoding
starts changes.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:  # for annotations only: the daemon's configuration reads DEFAULT_LOOKAHEAD without torch
    from decode.jobs import Job
    from shards.jpeg import BatchDecode

__all__ = ["DEFAULT_LOOKAHEAD", "LookAhead", "slow_positions"]

# Batches after those in flight whose slow windows may be decoded early (``--lookahead``).
DEFAULT_LOOKAHEAD = 4

# A window this many times its batch's median area is slow.
SLOW_FACTOR = 6.0
# Share of the mean slow area per batch that each run start may submit: above 1 so a
# backlog left by a burst of slow windows is worked off.
_CATCH_UP = 1.25
# Weight of the latest batch in the mean slow area per batch.
_MEAN_UPDATE = 0.05
# Batches seen without a slow window after which the look-ahead takes no more batches
# (reading batches early costs memory and cache for nothing on data without them).
QUIET_BATCHES = 64


def slow_positions(job: Job, factor: float = SLOW_FACTOR) -> np.ndarray:
    """Positions in ``job`` whose window's area is over ``factor`` times the batch's
    median window area (none in a batch of fewer than 4)."""
    boxes = job.crops.boxes
    if len(boxes) < 4:
        return np.empty(0, dtype=np.intp)
    areas = boxes[:, 2].astype(np.float64) * boxes[:, 3]
    return np.flatnonzero(areas > factor * float(np.median(areas)))


@dataclass
class _Window:
    job: Job
    position: int
    area: float
    decoding: BatchDecode | None = None  # once submitted


class LookAhead:
    """The slow windows of the batches to come, and those being decoded early.

    Args:
        submit: starts decoding one window of a job, into buffers of its own.
        factor: how many times its batch's median area makes a window slow.
    """

    def __init__(self, submit: Callable[[Job, int], BatchDecode], factor: float = SLOW_FACTOR) -> None:
        self._submit = submit
        self._factor = factor
        self._backlog: deque[_Window] = deque()  # not yet submitted, oldest batch first
        self._early: list[_Window] = []  # submitted, not yet taken
        self._added: deque[Job] = deque()  # added, not yet started
        self._mean_area = 0.0  # slow area per batch added (an exponentially weighted mean)
        self._tokens = 0.0
        self._quiet = QUIET_BATCHES  # batches seen since the last slow window
        self.submitted = 0  # windows decoded early, in all

    def __len__(self) -> int:
        """Slow windows not yet taken (waiting or decoding)."""
        return len(self._backlog) + len(self._early)

    @property
    def wanted(self) -> bool:
        """Whether batches should be shown to it: a slow window was seen in the last
        ``QUIET_BATCHES`` batches (:meth:`add` or :meth:`seen`)."""
        return self._quiet < QUIET_BATCHES

    def add(self, job: Job) -> None:
        """``job`` is coming: its slow windows join the backlog."""
        self._added.append(job)
        boxes = job.crops.boxes
        area = 0.0
        for p in slow_positions(job, self._factor):
            window = _Window(job, int(p), float(boxes[p, 2]) * float(boxes[p, 3]))
            self._backlog.append(window)
            area += window.area
        self._count(area)

    def seen(self, job: Job) -> None:
        """``job`` starts without having been added: counted, for :attr:`wanted`."""
        boxes = job.crops.boxes[slow_positions(job, self._factor)]
        self._count(float(np.sum(boxes[:, 2].astype(np.float64) * boxes[:, 3])))

    def _count(self, area: float) -> None:
        self._quiet = 0 if area > 0 else self._quiet + 1
        self._mean_area += _MEAN_UPDATE * (area - self._mean_area)

    def tick(self) -> None:
        """A run starts: submit the backlog's oldest windows, about a batch's mean
        slow area of them."""
        if not self._backlog:
            self._tokens = 0.0  # nothing waits: no credit saved for a burst later
            return
        rate = _CATCH_UP * self._mean_area
        self._tokens = min(self._tokens + rate, 2 * rate)
        while self._backlog and self._tokens > 0:
            window = self._backlog.popleft()
            window.decoding = self._submit(window.job, window.position)
            self._early.append(window)
            self._tokens -= window.area
            self.submitted += 1

    def take(self, job: Job) -> dict[int, BatchDecode]:
        """``job`` starts: its windows submitted early (position -> its decoding);
        its slow windows still on the backlog leave it (its run decodes them). A job
        that was not added (jobs start in the order they were added) is counted as
        :meth:`seen`."""
        if not (self._added and self._added[0] is job):
            self.seen(job)
            return {}
        self._added.popleft()
        taken = {w.position: w.decoding for w in self._early if w.job is job and w.decoding is not None}
        if taken:
            self._early = [w for w in self._early if w.job is not job]
        if self._backlog and any(w.job is job for w in self._backlog):
            self._backlog = deque(w for w in self._backlog if w.job is not job)
        return taken

    def drop(self) -> None:
        """Forget every window: wait for those decoding (their buffers are their
        own), drop the backlog."""
        for window in self._early:
            if window.decoding is not None and window.decoding.loop is not None:
                try:
                    window.decoding.loop.wait()
                except Exception:  # noqa: BLE001 - nobody wants these windows any more
                    pass
        self._early, self._backlog, self._added, self._tokens = [], deque(), deque(), 0.0
