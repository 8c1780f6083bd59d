"""Jobs and outcomes: the failing samples located once, for every runner."""

from __future__ import annotations

import pytest

from decode.jobs import SampleDecodeError, locate_failures
from tests.common.jobs import header_job, jpeg_bytes


def _job(n: int = 4):
    return header_job([jpeg_bytes(32, 32, i) for i in range(n)], 16)


def test_named_failures_are_kept_as_they_are():
    error = SampleDecodeError("bad", {2: "bad"})
    assert locate_failures(_job(), error, lambda job: pytest.fail("nothing to locate")) is error


def test_unnamed_failures_are_found_one_sample_at_a_time():
    job, tried = _job(), []

    def decodes_alone(one):
        tried.append(one.jpegs[0].tobytes())
        return one.jpegs[0] is not job.jpegs[1] and one.jpegs[0] is not job.jpegs[3]

    located = locate_failures(job, SampleDecodeError("run failed"), decodes_alone)
    assert located.failures == {1: "run failed", 3: "run failed"} and len(tried) == 4


def test_a_run_that_fails_with_every_sample_fine_alone_blames_none():
    error = SampleDecodeError("the pipeline broke")
    with pytest.raises(SampleDecodeError) as caught:
        locate_failures(_job(), error, lambda one: True)
    assert caught.value is error


def test_a_job_of_some_positions_keeps_their_windows():
    job = _job()
    part = job.only([3, 1])
    assert [j is job.jpegs[k] for j, k in zip(part.jpegs, (3, 1))] == [True, True]
    assert part.crops.boxes.tolist() == job.crops.boxes[[3, 1]].tolist()
