"""A bounded pool of built DALI pipelines keyed by what fixes them, so streams reuse
pipelines instead of building one per stream (a build takes ~100 ms and a few MB).

Crop ranges, image size, transform and batch size are per-run inputs, not part of a
pipeline's identity (:class:`PipelineSpec`); what remains is the batch-size bucket,
the resize filter and the device, threads and prefetch: a few dozen specs at most.
Each open stream holds a runner of its own, so the pool bounds the runners alive at
once (lent plus idle, ``max_pipelines``), drops an idle one, oldest first, when a new
one must be built at the bound, and drops idle ones after
``idle_s`` with their threads and buffers (DALI keeps a pipeline's peak buffers while
it lives).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from core.errors import ResourceExhausted
from core.workers import FairPool
from decode.pipeline import PipelineSpec
from decode.runner import PipelineRunner

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


@dataclass(frozen=True)
class _Idle:
    runner: PipelineRunner
    since_s: float  # time.monotonic() when it was given back


class PipelinePool:
    """Lends each stream a runner of its own, built or reused; at most
    ``max_pipelines`` runners are alive (lent or idle).

    Args:
        max_pipelines: runners alive at once.
        idle_s: an idle runner is dropped after this many seconds.
        on_change: called with the number of runners alive whenever it changes.
        idle_per_spec: idle runners kept per spec; more are dropped on return.
        workers: the threads runners work on (each gets a lane of its own); None:
            each runner on threads of its own (``spec.threads``).
    """

    def __init__(
        self,
        max_pipelines: int = 64,
        idle_s: float = 30.0,
        on_change: Callable[[int], None] = lambda _: None,
        idle_per_spec: int = 2,
        workers: FairPool | None = None,
    ) -> None:
        self._workers = workers
        self.max_pipelines = max_pipelines
        self.idle_s = idle_s
        self._on_change = on_change
        self._idle_per_spec = idle_per_spec
        self._idle: list[_Idle] = []  # oldest first
        self._alive = 0  # lent + idle + being built
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._closed = False

    def acquire(self, spec: PipelineSpec) -> PipelineRunner:
        """An idle runner for ``spec``, or a newly built one (dropping the oldest idle
        runner of another spec when ``max_pipelines`` are alive).

        Raises:
            ResourceExhausted: ``max_pipelines`` runners are all lent to streams.
            RuntimeError: DALI could not build the pipeline.
        """
        with self._lock:
            for k in range(len(self._idle) - 1, -1, -1):  # the most recently used: warmest
                if self._idle[k].runner.spec == spec:
                    return self._idle.pop(k).runner
            evicted = None
            if self._alive >= self.max_pipelines:
                if not self._idle:
                    raise ResourceExhausted(
                        f"max_pipelines: all {self.max_pipelines} pipelines are lent to open streams"
                    )
                evicted = self._idle.pop(0).runner
            else:
                self._alive += 1
        if evicted is not None:
            evicted.close()  # its slot passes to the new runner
        try:
            runner = PipelineRunner(spec, None if self._workers is None else self._workers.lane())
        except BaseException:
            self._dropped(1)
            raise
        self._on_change(self.alive_count())
        return runner

    def release(self, runner: PipelineRunner) -> None:
        """Return ``runner``; a broken runner, one that cannot drain, or one too many
        is dropped."""
        healthy = not runner.broken
        if healthy:
            try:
                runner.drain()
            except Exception:  # noqa: BLE001 - a runner that cannot drain is not reused
                healthy = False
        with self._lock:
            same = sum(1 for idle in self._idle if idle.runner.spec == runner.spec)
            if healthy and not self._closed and same < self._idle_per_spec:
                self._idle.append(_Idle(runner, time.monotonic()))
                self._start_reaper()
                return
        runner.close()
        self._dropped(1)

    def idle_count(self) -> int:
        """Idle runners held now."""
        with self._lock:
            return len(self._idle)

    def alive_count(self) -> int:
        """Runners built and not dropped (lent, idle or being built)."""
        with self._lock:
            return self._alive

    def drop_idle(self, older_than_s: float = 0.0) -> int:
        """Drop the idle runners given back more than ``older_than_s`` ago; returns
        how many."""
        deadline = time.monotonic() - older_than_s
        with self._lock:
            old = [idle for idle in self._idle if idle.since_s <= deadline]
            self._idle = [idle for idle in self._idle if idle.since_s > deadline]
        for idle in old:
            idle.runner.close()
        if old:
            self._dropped(len(old))
        return len(old)

    def close(self) -> None:
        """Drop every idle runner and stop the reaper; later releases are dropped too."""
        with self._lock:
            self._closed = True
            self._wake.notify_all()
            reaper = self._reaper
        if reaper is not None:
            reaper.join()
        self.drop_idle()

    def _dropped(self, count: int) -> None:
        with self._lock:
            self._alive -= count
            alive = self._alive
        self._on_change(alive)

    def _start_reaper(self) -> None:
        """Start the thread that drops idle runners (caller holds the lock)."""
        if self._reaper is None:
            self._reaper = threading.Thread(target=self._reap, name="feeder-pool-reaper", daemon=True)
            self._reaper.start()

    def _reap(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                oldest = min((idle.since_s for idle in self._idle), default=None)
                wait_s = self.idle_s if oldest is None else max(0.0, oldest + self.idle_s - time.monotonic())
                self._wake.wait(timeout=wait_s + 0.01)
                if self._closed:
                    return
            self.drop_idle(self.idle_s)
