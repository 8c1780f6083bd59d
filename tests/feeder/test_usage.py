"""Per-stream and per-job use in Prometheus: counters hold everything a job's
streams took, rates are over the watcher's interval, and a job's labels go with its
last stream."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from feeder.metrics import ServerMetrics
from feeder.usage import Usage


@dataclass(eq=False)
class _Stream:
    label: str
    busy_s: float = 0.0
    cpu_s: float = 0.0
    samples_sent: int = 0
    consumer_wait_s: float = 0.0
    starved_s: float = 0.0
    queue_fill: float = 0.0

    def work(self, seconds: float, images: int) -> None:
        self.busy_s += seconds
        self.cpu_s += 0.9 * seconds
        self.samples_sent += images


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _value(metrics: ServerMetrics, name: str, job: str) -> float | None:
    return metrics.registry.get_sample_value(name, {"job": job})


def test_a_jobs_use_is_the_sum_of_its_streams_and_goes_with_its_last_stream():
    metrics, clock = ServerMetrics(), _Clock()
    usage = Usage(metrics, clock)
    ranks = [_Stream(str(k)) for k in range(2)]
    other = _Stream("9")
    for stream in ranks:
        usage.opened(stream, "job-a")
    usage.opened(other, "job-b")
    clock.now = 2.0
    ranks[0].work(1.0, 100)
    ranks[1].work(0.5, 60)
    other.work(1.5, 40)
    usage.tick()
    assert _value(metrics, "feeder_job_decode_seconds_total", "job-a") == pytest.approx(1.5)
    assert _value(metrics, "feeder_job_cpu_seconds_total", "job-a") == pytest.approx(1.35)
    assert _value(metrics, "feeder_job_images_total", "job-a") == 160
    assert _value(metrics, "feeder_job_threads", "job-a") == pytest.approx(0.75)  # 1.5 s over 2 s
    assert _value(metrics, "feeder_job_images_per_second", "job-a") == pytest.approx(80)
    assert _value(metrics, "feeder_job_streams", "job-a") == 2
    assert metrics.registry.get_sample_value("feeder_stream_cpu_seconds", {"stream": "9"}) == pytest.approx(1.35)
    ranks[0].work(1.0, 10)  # after the tick, before it closes: booked at the close
    usage.closed(ranks[0])
    assert _value(metrics, "feeder_job_decode_seconds_total", "job-a") == pytest.approx(2.5)
    assert metrics.registry.get_sample_value("feeder_stream_cpu_seconds", {"stream": "0"}) is None
    usage.closed(ranks[1])
    for name in ("feeder_job_decode_seconds_total", "feeder_job_cpu_seconds_total", "feeder_job_images_total",
                 "feeder_job_threads", "feeder_job_images_per_second", "feeder_job_streams"):
        assert _value(metrics, name, "job-a") is None, name
    assert _value(metrics, "feeder_job_streams", "job-b") == 1
    usage.closed(ranks[1])  # twice: nothing


def test_a_jobs_label_is_cut_to_the_logs_length():
    metrics = ServerMetrics()
    usage = Usage(metrics, _Clock())
    usage.opened(_Stream("1"), "j" * 10_000)
    usage.tick()
    (family,) = [f for f in metrics.registry.collect() if f.name == "feeder_job_streams"]
    assert len(family.samples) == 1 and len(family.samples[0].labels["job"]) <= 200
