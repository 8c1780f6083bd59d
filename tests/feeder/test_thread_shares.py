"""The daemon's --threads, shared by every stream: never more decode threads than
the budget, equal rates for equal jobs, and a job that had the node alone gives half
back as soon as a second job opens."""

from __future__ import annotations

import threading
import time

import pytest

from feeder.service import FeederService
from protocol.request import StreamSpec
from shards import jpeg

pytestmark = [pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason())), pytest.mark.serial]

_THREADS = 2



class _Job:
    """One job's stream, read as fast as it comes, its batches timed."""

    def __init__(self, service: FeederService, seed: int, batch_size: int = 8, runs: int | None = None) -> None:
        spec = StreamSpec(dataset="s", split="train", batch_size=batch_size, image_size=64, seed=seed,
                          epochs=10_000)
        self.stream = service.open_stream(spec)
        if runs is not None:  # runs in flight: more than the service's 2 keep its lane busy on a loaded machine
            self.stream.prefetch = runs
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        for _ in self.stream:
            self.times.append(time.monotonic())

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)


_WINDOW_S = 8.0


def _open_at_once(two_thread_service: FeederService, count: int) -> list[_Job]:
    jobs: list[_Job | None] = [None] * count
    barrier = threading.Barrier(count)

    def open_one(k: int) -> None:
        barrier.wait()
        jobs[k] = _Job(two_thread_service, seed=k)

    openers = [threading.Thread(target=open_one, args=(k,)) for k in range(count)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join()
    return [job for job in jobs if job is not None]


def test_jobs_opened_at_once_share_the_budget_evenly_on_no_more_threads(two_thread_service):
    jobs = _open_at_once(two_thread_service, 8)
    try:
        for job in jobs:
            job.thread.start()
        time.sleep(1.0)  # past the first batches
        start = time.monotonic()
        time.sleep(_WINDOW_S)
        rates = [job.rate(start, start + _WINDOW_S) for job in jobs]
        decoding = [t.name for t in threading.enumerate() if t.name.startswith("feeder-decode")]
        print(f"{len(decoding)} decode threads; fastest job / slowest: {max(rates) / min(rates):.3f}")  # with -s
        assert len(decoding) == _THREADS  # the budget, however many streams
        assert not [t.name for t in threading.enumerate() if t.name.startswith(("feeder-resize", "feeder-cache"))]
        # The target is 15 % (1.01-1.03 on a quiet machine, docs/performance.md); beside
        # two CPU-bound processes the jobs' reader threads are scheduled unevenly too:
        # 1.11-1.19 over 8 s (1.25-1.66 over 3 s). A job starved of its share is far
        # outside this.
        assert min(rates) > 0 and max(rates) / min(rates) <= 1.3, rates
    finally:
        for job in jobs:
            job.stream.close()


def _threads(jobs: list[_Job], seconds: float) -> list[float]:
    """Decode threads each job's stream kept busy over the next ``seconds`` (worker
    time over wall time: its share of the pool, however loaded the machine)."""
    before, start = [job.stream.busy_s for job in jobs], time.monotonic()
    time.sleep(seconds)
    wall = time.monotonic() - start
    return [(job.stream.busy_s - b) / wall for job, b in zip(jobs, before)]


def test_a_job_alone_gives_half_the_threads_back_when_a_second_opens(photo_service):
    # Batches of 256 of photographs, 8 runs in flight each: a stream's own work per
    # batch (its plan, its slot, the hand-over to its reader) is small beside its
    # decodes, and its lane always has some queued, also when a loaded machine holds its
    # threads up (with batches of 64 of small images and 2 runs, a held-up producer
    # handed its share to the other stream: 0.78 and 0.95 threads, a fresh make test).
    first = _Job(photo_service, seed=1, batch_size=256, runs=8)
    first.thread.start()
    second = None
    try:
        time.sleep(1.0)
        (alone,) = _threads([first], 2.0)
        second = _Job(photo_service, seed=2, batch_size=256, runs=8)
        second.thread.start()
        time.sleep(1.0)  # within a few seconds
        shared = _threads([first, second], 2.0)
        print(f"threads alone {alone:.2f}, then {shared[0]:.2f} and {shared[1]:.2f}")  # with -s
        # Alone it had the pool: as much as the two get together (what the machine lets
        # two threads do now, measured here, not a figure of a quiet machine).
        assert alone >= 0.8 * sum(shared), (alone, shared)
        assert shared[0] < 0.8 * alone, (alone, shared)  # it gave about half back
        assert abs(shared[0] - shared[1]) <= 0.15 * max(shared), shared
    finally:
        first.stream.close()
        if second is not None:
            second.stream.close()
