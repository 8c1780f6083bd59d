"""The pipeline pool is bounded: distinct crop ranges and batch sizes reuse a few
pipelines, idle ones are dropped oldest first or after ``pipeline_idle_s``, and a
stream that finds every pipeline lent is refused."""

from __future__ import annotations

import threading

import pytest

from core.errors import ResourceExhausted
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.request import CropRange, StreamSpec
from tests.common.waiting import wait_for

STREAMS = 250


@pytest.fixture()
def service_with(shards):
    services = []

    def make(**options):
        config = ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=1, max_batch_size=64, **options)
        services.append(FeederService(config, open_datasets(config.datasets), ServerMetrics()))
        return services[-1]

    yield make
    for service in services:
        service.close()


@pytest.mark.slow
def test_distinct_crops_and_batch_sizes_build_a_bounded_number_of_pipelines(service_with):
    before = threading.active_count()
    service = service_with(max_pipelines=2, pipeline_idle_s=1.0)
    alive, threads = [], []
    for i in range(STREAMS):
        # Every stream another min_scale; batch sizes 1..64 need pipelines of 16, 32 and 64.
        spec = StreamSpec("sample", "train", batch_size=1 + i % 64, image_size=16,
                          crop=CropRange(min_scale=0.05 + i * 0.003))
        stream = service.open_stream(spec)
        next(iter(stream))
        stream.close()
        alive.append(service.parts.pool.alive_count())
        threads.append(threading.active_count())
    assert max(alive) == 2  # three batch-size buckets, two pipelines: the oldest idle one made way
    assert service.metrics.stats().pipelines <= 2
    assert max(threads) <= before + 8  # two pipelines' threads and the pool's reaper
    # Idle for pipeline_idle_s: dropped with their threads.
    assert wait_for(lambda: service.parts.pool.alive_count() == 0, timeout_s=5.0)
    assert service.metrics.stats().pipelines == 0
    # The pool's reaper, the idle-stream watcher and the daemon's decode threads stay.
    threads = service.config.tuning.decode_threads
    assert wait_for(lambda: threading.active_count() <= before + 2 + threads, timeout_s=5.0)


def test_a_stream_that_finds_every_pipeline_lent_is_refused_naming_the_limit(service_with):
    service = service_with(max_pipelines=1)
    held = service.open_stream(StreamSpec("sample", "train", batch_size=4, image_size=16))
    try:
        with pytest.raises(ResourceExhausted, match="max_pipelines"):
            service.open_stream(StreamSpec("sample", "val", batch_size=4, image_size=16))
    finally:
        held.close()
    other = service.open_stream(StreamSpec("sample", "val", batch_size=4, image_size=16))
    assert len(next(iter(other)).meta) == 4  # the train stream's pipeline, idle now, serves val too
    other.close()
    assert service.parts.pool.alive_count() == 1
