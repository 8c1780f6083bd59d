"""A small pool of built DALI pipelines keyed by what fixes them, so streams reuse
pipelines instead of building one per stream (a build takes ~100 ms and a few MB)."""

from __future__ import annotations

import itertools
import threading
from collections import defaultdict

from feeder.pipeline import PipelineRunner, PipelineSpec

__all__ = ["PipelinePool", "batch_bucket"]

_MIN_BUCKET = 16


def batch_bucket(batch_size: int, max_batch_size: int) -> int:
    """Pipeline capacity for a request: the next power of two (at least 16), capped at
    the daemon's maximum. A few capacities serve every batch size; a pipeline's
    buffers grow only to what its batches use."""
    bucket = _MIN_BUCKET
    while bucket < batch_size:
        bucket *= 2
    return min(bucket, max_batch_size)


class PipelinePool:
    """Lends each stream a runner of its own; keeps up to ``idle_per_spec`` idle
    runners per spec for the next stream.

    Args:
        idle_per_spec: idle runners kept per spec; more are dropped on return.
    """

    def __init__(self, idle_per_spec: int = 2) -> None:
        self._idle_per_spec = idle_per_spec
        self._idle: dict[PipelineSpec, list[PipelineRunner]] = defaultdict(list)
        self._lock = threading.Lock()
        self._seeds = itertools.count(1)  # only for runs without windows; streams bring theirs
        self._closed = False

    def acquire(self, spec: PipelineSpec) -> PipelineRunner:
        """An idle runner for ``spec``, or a newly built one."""
        with self._lock:
            if self._idle[spec]:
                return self._idle[spec].pop()
            seed = next(self._seeds)
        return PipelineRunner(spec, seed=seed)

    def release(self, runner: PipelineRunner, healthy: bool = True) -> None:
        """Return ``runner``; a runner that failed, or one too many, is dropped."""
        if healthy:
            try:
                runner.drain()
            except Exception:  # noqa: BLE001 - a runner that cannot drain is not reused
                healthy = False
        with self._lock:
            idle = self._idle[runner.spec]
            if healthy and not self._closed and len(idle) < self._idle_per_spec:
                idle.append(runner)
                return
        runner.close()

    def idle_count(self) -> int:
        """Idle runners held now."""
        with self._lock:
            return sum(len(v) for v in self._idle.values())

    def close(self) -> None:
        """Drop every idle runner; later releases are dropped too."""
        with self._lock:
            self._closed = True
            runners = [r for idle in self._idle.values() for r in idle]
            self._idle.clear()
        for runner in runners:
            runner.close()
