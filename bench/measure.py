"""The timed part: consume a loader's batches in windows of fixed length.

Setup ends when the first batch arrives. Then a warm-up of ``warmup_s``, then
``repeats`` windows of at least ``seconds`` each; a window closes at the first batch
that arrives after its nominal end, so it always holds whole batches and its length is
measured, not assumed. CPU time of the loader's whole process tree is read at the same
moments.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

from bench.loaders import Batch, LoaderSpec, check_batch, loader_module
from bench.proctree import cpu_seconds

__all__ = ["Schedule", "Window", "consume"]

# Distinct problems a client keeps (a broken loader repeats the same one every batch).
_MAX_PROBLEMS = 5


@dataclass(frozen=True)
class Schedule:
    """How long to measure.

    Args:
        warmup_s: seconds consumed and discarded after the first batch.
        seconds: minimum length of each measured window.
        repeats: number of measured windows (the median is reported).
        epoch_batches: 0: windows of ``seconds``; else each window is one epoch of
            this many batches (the first epoch less its first batch, which ends
            setup), with no warm-up, so that a first pass (a cache filling) and later
            passes are measured apart.
    """

    warmup_s: float = 2.0
    seconds: float = 10.0
    repeats: int = 3
    epoch_batches: int = 0

    def __post_init__(self) -> None:
        if self.warmup_s < 0 or self.seconds <= 0 or self.repeats < 1 or self.epoch_batches < 0:
            raise ValueError("warmup_s >= 0, seconds > 0, repeats >= 1 and epoch_batches >= 0 are required")


@dataclass(frozen=True)
class Window:
    """One measured window of one consumer."""

    images: int
    duration_s: float
    cpu_s: float
    first_epoch: bool = False  # with epoch windows: the first pass over the data


def _timed_windows(
    batches: Iterator[Batch], spec: LoaderSpec, schedule: Schedule, cpu_root: int, problems: list[str]
) -> tuple[list[Window], int]:
    start = time.monotonic()
    boundaries = [start + schedule.warmup_s + k * schedule.seconds for k in range(schedule.repeats + 1)]
    marks: list[tuple[float, int, float]] = []  # (time, images so far, tree CPU seconds)
    images = checked = 0
    for batch in batches:
        now = time.monotonic()
        images += batch.count
        checked += 1
        for problem in check_batch(batch, spec):
            if problem not in problems and len(problems) < _MAX_PROBLEMS:
                problems.append(problem)
        if now >= boundaries[len(marks)]:
            marks.append((now, images, cpu_seconds(cpu_root)))
            if len(marks) == len(boundaries):
                break
    windows = [Window(b[1] - a[1], b[0] - a[0], b[2] - a[2]) for a, b in zip(marks, marks[1:])]
    return windows, checked


def _epoch_windows(
    batches: Iterator[Batch], spec: LoaderSpec, schedule: Schedule, cpu_root: int, problems: list[str]
) -> tuple[list[Window], int]:
    """One window per epoch of ``schedule.epoch_batches`` batches (the first batch,
    already taken, ends setup and belongs to the first epoch)."""
    marks = [(time.monotonic(), 0, cpu_seconds(cpu_root))]
    images = checked = 0
    for batch in batches:
        images += batch.count
        checked += 1
        for problem in check_batch(batch, spec):
            if problem not in problems and len(problems) < _MAX_PROBLEMS:
                problems.append(problem)
        if (checked + 1) % schedule.epoch_batches == 0:
            marks.append((time.monotonic(), images, cpu_seconds(cpu_root)))
            if len(marks) == schedule.repeats + 1:
                break
    windows = [Window(b[1] - a[1], b[0] - a[0], b[2] - a[2], first_epoch=k == 0)
               for k, (a, b) in enumerate(zip(marks, marks[1:]))]
    return windows, checked


def consume(
    name: str, spec: LoaderSpec, schedule: Schedule, cpu_root: int, shared: object = None, barrier: Any = None
) -> dict:
    """Opens loader ``name``, waits at ``barrier`` (if any) once it delivers, and measures.

    Args:
        name: a key of ``bench.loaders.LOADERS``.
        spec: the work and budget.
        schedule: warm-up and windows.
        cpu_root: process whose tree's CPU time is charged to this loader.
        shared: what the loader's ``open_shared`` yielded, if it has one.
        barrier: a ``multiprocessing.Barrier`` lining up concurrent consumers.

    Returns:
        ``{"rank", "setup_s", "batches", "problems", "windows": [Window as dict]}``.
    """
    opened = time.monotonic()
    with loader_module(name).open_loader(spec, shared) as batches:
        first = next(batches)
        setup_s = time.monotonic() - opened
        problems = check_batch(first, spec)[:_MAX_PROBLEMS]
        if barrier is not None:
            barrier.wait()
        measure = _epoch_windows if schedule.epoch_batches else _timed_windows
        windows, checked = measure(batches, spec, schedule, cpu_root, problems)
    return {
        "rank": spec.client_rank,
        "setup_s": setup_s,
        "batches": checked + 1,
        "problems": problems,
        "windows": [asdict(w) for w in windows],
    }
