"""Slow samples decoded ahead of their batches (:mod:`decode.look_ahead`): which
windows are slow, the steady rate they are submitted at, and through the runner the
same pixels in the same order as without a look-ahead, each slow window started
before its batch, and a slow window that fails named in its own batch."""

from __future__ import annotations

import numpy as np
import pytest

from decode.augment import Crops
from decode.jobs import Decoded, Failed, Job
from decode.look_ahead import LookAhead, slow_positions
from decode.pipeline import PipelineSpec
from decode.runner import PipelineRunner
from shards import jpeg
from shards.jpeg import BatchDecode
from tests.common.jobs import header_job, jpeg_bytes

pytestmark = pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))


def _job(areas: list[int]) -> Job:
    """A job of square windows of the given areas (no bytes: for the look-ahead's bookkeeping)."""
    sides = np.sqrt(np.array(areas, dtype=np.float64)).astype(np.int64)
    boxes = np.stack([np.zeros_like(sides), np.zeros_like(sides), sides, sides], axis=1)
    return Job([np.empty(0, np.uint8)] * len(areas), 32, Crops(boxes=boxes, flips=np.zeros(len(areas), bool)))


class _Submitted:
    def __init__(self) -> None:
        self.windows: list[tuple[Job, int]] = []

    def __call__(self, job: Job, position: int) -> BatchDecode:
        self.windows.append((job, position))
        return BatchDecode(windows=[None] * len(job))


def test_a_window_is_slow_when_its_area_is_many_times_its_batch_median() -> None:
    assert list(slow_positions(_job([100] * 7 + [10_000]))) == [7]
    assert list(slow_positions(_job([100, 400, 50, 590, 100]))) == []  # RandomResizedCrop's own spread
    assert list(slow_positions(_job([100, 100, 10_000]))) == []  # too few to have a median worth trusting


def test_slow_windows_are_submitted_oldest_first_at_about_the_rate_they_arrive() -> None:
    submitted = _Submitted()
    ahead = LookAhead(submitted)
    jobs = [_job([100] * 15 + ([10_000] if i % 4 == 0 else [100])) for i in range(40)]
    for job in jobs[:4]:
        ahead.add(job)
    started = 0
    for job in jobs[4:]:  # each run that starts lets one more batch into the look-ahead
        ahead.tick()
        ahead.take(jobs[started])
        started += 1
        ahead.add(job)
    # One slow window every 4 batches, each submitted before its batch started, in order.
    order = [next(i for i, x in enumerate(jobs) if x is j) for j, _ in submitted.windows]
    assert order == sorted(order)
    assert all(p == 15 for _, p in submitted.windows)
    assert len(submitted.windows) >= 7 and ahead.submitted == len(submitted.windows)
    # Never a burst: at most one slow window submitted per run started.
    assert len(submitted.windows) <= started


def test_a_batch_that_starts_takes_its_early_windows_and_decodes_the_rest_itself() -> None:
    submitted = _Submitted()
    ahead = LookAhead(submitted)
    first, second = _job([100] * 7 + [10_000]), _job([100] * 7 + [20_000])
    ahead.add(first)
    ahead.add(second)
    ahead.tick()  # one batch's worth of area: the first's window only, the second's waits
    assert [p for _, p in submitted.windows] == [7] and len(ahead) == 2
    assert list(ahead.take(first)) == [7]
    assert ahead.take(second) == {}  # not submitted: it leaves the backlog, its run decodes it
    assert len(ahead) == 0


def _batches(count: int, slow: set[int], size: int = 8) -> list[Job]:
    """Batches of small JPEGs; the listed batches have one large JPEG at position 3."""
    small = [jpeg_bytes(48 + 4 * i, 40, i) for i in range(size)]
    large = jpeg_bytes(640, 480, 99)
    return [header_job([large if b in slow and i == 3 else small[i] for i in range(size)], 32) for b in range(count)]


def _run(jobs: list[Job], lookahead: int) -> tuple[list, int]:
    runner = PipelineRunner(PipelineSpec(cpu_decoder="libjpeg-turbo", max_batch_size=8, threads=2, prefetch=1))
    runner.lookahead = lookahead
    try:
        outcomes = list(runner.run_many(jobs))
        early = runner._decoder.decoded_early  # noqa: SLF001 - what the decoder did, not what it returned
        runner.drain()
        return outcomes, early
    finally:
        runner.close()


def test_the_look_ahead_gives_the_same_pixels_in_the_same_order() -> None:
    jobs = _batches(12, slow={2, 3, 7, 11})
    plain, none_early = _run(jobs, lookahead=0)
    ahead, early = _run(jobs, lookahead=4)
    assert none_early == 0 and early >= 2  # the first ones' batches start before the look-ahead holds them
    assert all(isinstance(o, Decoded) for o in plain + ahead)
    for a, b in zip(plain, ahead, strict=True):
        assert a.job is b.job and np.array_equal(a.slot.array, b.slot.array)


def test_a_slow_window_that_fails_early_fails_its_own_batch_by_position() -> None:
    jobs = _batches(8, slow={1})  # the look-ahead starts with the first slow window seen
    broken = bytearray(jpeg_bytes(640, 480, 7).tobytes())
    broken[broken.index(b"\xff\xda") + 6] = 0x33  # a scan that asks for tables the file lacks
    bad = np.frombuffer(bytes(broken), np.uint8)
    widths_from = header_job([jpeg_bytes(640, 480, 7)], 32)  # the window the intact file would have
    job = jobs[5]
    boxes = job.crops.boxes.copy()
    boxes[3] = widths_from.crops.boxes[0]
    jobs[5] = Job([*job.jpegs[:3], bad, *job.jpegs[4:]], 32, Crops(boxes=boxes, flips=job.crops.flips))
    outcomes, early = _run(jobs, lookahead=4)
    assert early == 1
    failed = [i for i, o in enumerate(outcomes) if isinstance(o, Failed)]
    assert failed == [5] and sorted(outcomes[5].error.failures) == [3]
    assert all(o.job is j for o, j in zip(outcomes, jobs, strict=True))


def test_without_slow_windows_the_runner_takes_no_batch_beyond_those_in_flight() -> None:
    jobs = _batches(20, slow={12})
    taken = []

    def counted():
        for i, job in enumerate(jobs):
            taken.append(i)
            yield job

    runner = PipelineRunner(PipelineSpec(cpu_decoder="libjpeg-turbo", max_batch_size=8, threads=2, prefetch=2))
    try:
        outcomes = runner.run_many(counted())
        for i in range(11):
            next(outcomes)
            assert len(taken) <= i + 1 + 2  # the one handed out and those in flight, no more
        next(outcomes)  # batch 12 starts before batch 11 is handed out
        assert len(taken) == 13 + 4  # its slow window seen: the look-ahead takes 4 more
        list(outcomes)
    finally:
        runner.close()


def test_a_runner_left_with_windows_decoding_early_serves_the_next_stream_alike() -> None:
    jobs = _batches(12, slow={1, 2, 4, 5, 6, 8})
    runner = PipelineRunner(PipelineSpec(cpu_decoder="libjpeg-turbo", max_batch_size=8, threads=2, prefetch=1))
    try:
        outcomes = runner.run_many(jobs)
        for _ in range(3):
            next(outcomes)
        assert runner._decoder.decoded_early > 0  # noqa: SLF001 - windows of later batches were decoding
        outcomes.close()  # the consumer went away
        runner.drain()  # what the pipeline pool does before lending the runner again
        again = [o.slot.array for o in runner.run_many(jobs[6:])]
    finally:
        runner.close()
    fresh, _ = _run(jobs[6:], lookahead=4)
    assert len(again) == len(fresh) == 6
    assert all(np.array_equal(a, f.slot.array) for a, f in zip(again, fresh, strict=True))
