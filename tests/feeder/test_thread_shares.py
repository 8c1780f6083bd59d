"""The daemon's --threads, shared by every stream: never more decode threads than
the budget, equal rates for equal jobs, and a job that had the node alone gives half
back as soon as a second job opens."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.request import StreamSpec
from shards import jpeg

pytestmark = pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))

_THREADS = 2


@pytest.fixture()
def service(shards: Path):
    config = ServerConfig(datasets={"s": shards}, device="cpu", threads=_THREADS, max_batch_size=64)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    yield service
    service.close()


class _Job:
    """One job's stream, read as fast as it comes, its batches timed."""

    def __init__(self, service: FeederService, seed: int) -> None:
        spec = StreamSpec(dataset="s", split="train", batch_size=8, image_size=64, seed=seed, epochs=10_000)
        self.stream = service.open_stream(spec)
        self.times: list[float] = []
        self.thread = threading.Thread(target=self._read, daemon=True)

    def _read(self) -> None:
        for _ in self.stream:
            self.times.append(time.monotonic())

    def rate(self, start: float, end: float) -> float:
        return sum(start <= t < end for t in self.times) / (end - start)


def _open_at_once(service: FeederService, count: int) -> list[_Job]:
    jobs: list[_Job | None] = [None] * count
    barrier = threading.Barrier(count)

    def open_one(k: int) -> None:
        barrier.wait()
        jobs[k] = _Job(service, seed=k)

    openers = [threading.Thread(target=open_one, args=(k,)) for k in range(count)]
    for opener in openers:
        opener.start()
    for opener in openers:
        opener.join()
    return [job for job in jobs if job is not None]


def test_jobs_opened_at_once_share_the_budget_evenly_on_no_more_threads(service):
    jobs = _open_at_once(service, 8)
    try:
        for job in jobs:
            job.thread.start()
        time.sleep(1.0)  # past the first batches
        start = time.monotonic()
        time.sleep(3.0)
        rates = [job.rate(start, start + 3.0) for job in jobs]
        decoding = [t.name for t in threading.enumerate() if t.name.startswith("feeder-decode")]
        assert len(decoding) == _THREADS  # the budget, however many streams
        assert not [t.name for t in threading.enumerate() if t.name.startswith(("feeder-resize", "feeder-cache"))]
        assert min(rates) > 0 and max(rates) / min(rates) <= 1.15, rates
    finally:
        for job in jobs:
            job.stream.close()


def test_a_job_alone_gives_half_the_threads_back_when_a_second_opens(service):
    first = _Job(service, seed=1)
    first.thread.start()
    try:
        time.sleep(2.0)
        alone = first.rate(time.monotonic() - 1.0, time.monotonic())
        second = _Job(service, seed=2)
        second.thread.start()
        opened = time.monotonic()
        time.sleep(3.0)
        shared = (first.rate(opened + 1.0, opened + 3.0), second.rate(opened + 1.0, opened + 3.0))
        assert max(shared) / min(shared) <= 1.15, shared
        assert shared[0] < 0.7 * alone, (alone, shared)  # it gave about half back
        second.stream.close()
    finally:
        first.stream.close()


def test_each_stream_s_threads_queue_and_wait_are_reported(service):
    jobs = [_Job(service, seed=k) for k in range(2)]
    try:
        for job in jobs:
            job.thread.start()
        time.sleep(3.0)
        registry = service.metrics.registry
        threads = [registry.get_sample_value("feeder_stream_threads", {"stream": job.stream.label}) for job in jobs]
        assert all(t is not None and t > 0.3 for t in threads), threads
        assert sum(threads) <= _THREADS + 0.3, threads
        for job in jobs:
            fill = registry.get_sample_value("feeder_stream_queue_fill", {"stream": job.stream.label})
            wait = registry.get_sample_value("feeder_stream_consumer_wait_seconds", {"stream": job.stream.label})
            assert fill is not None and 0 <= fill <= 1 and wait is not None and wait > 0
    finally:
        for job in jobs:
            job.stream.close()
    assert registry.get_sample_value("feeder_stream_threads", {"stream": jobs[0].stream.label}) is None
