"""The device's idle time between steps (:mod:`clients.idle`): on the CPU from the
wall clock (a clock the test sets, so the figures are exact), and as a loader counts
it over a real daemon's epoch; on a GPU from events read without a synchronisation."""

from __future__ import annotations

import pytest
import torch

from clients import FeederLoader, IdleShare, StepGaps
from tests.common.sample_daemon import N_TRAIN


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_idle_is_the_time_between_a_steps_end_and_the_next_ones_start(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr("clients.idle.time.perf_counter", clock)
    gaps = StepGaps(torch.device("cpu"))
    for start, end in ((0.0, 3.0), (5.0, 6.0), (6.5, 8.0)):
        clock.now = start
        gaps.started()
        clock.now = end
        gaps.ended()
    share = gaps.share()
    assert share == IdleShare(idle_s=2.5, busy_s=5.5, steps=3)
    assert share.fraction == pytest.approx(2.5 / 8)
    gaps.reset()
    assert gaps.share() == IdleShare() and gaps.share().fraction == 0.0


def test_a_step_not_ended_yet_is_not_counted(monkeypatch) -> None:
    clock = _Clock()
    monkeypatch.setattr("clients.idle.time.perf_counter", clock)
    gaps = StepGaps(torch.device("cpu"))
    gaps.started()
    clock.now = 1.0
    gaps.ended()
    clock.now = 4.0
    gaps.started()  # its end is not marked yet
    assert gaps.share() == IdleShare(idle_s=3.0, busy_s=1.0, steps=1)
    clock.now = 4.5
    gaps.ended()
    assert gaps.share() == IdleShare(idle_s=3.0, busy_s=1.5, steps=2)


def test_the_loader_counts_each_step_of_its_epoch(daemon) -> None:
    with FeederLoader("sample", address=daemon, batch_size=8, image_size=32, rank=0, world_size=1) as loader:
        batches = sum(1 for _ in loader)
        share = loader.device_idle
        assert batches == N_TRAIN // 8 and share.steps == batches  # every step, the last one too
        assert share.idle_s > 0 and share.busy_s >= 0 and 0 < share.fraction <= 1
        for index, _ in enumerate(loader):  # a new epoch counts afresh
            if index == 1:
                assert loader.device_idle.steps == 1
                break


@pytest.mark.gpu
def test_on_a_gpu_idle_time_is_read_from_events_once_they_completed() -> None:
    gaps = StepGaps(torch.device("cuda", 0))
    a = torch.randn(2048, 2048, device="cuda")
    for _ in range(3):
        gaps.started()
        for _ in range(20):
            a = a @ a
            a /= a.norm()
        gaps.ended()
    torch.cuda.synchronize()
    share = gaps.share()
    assert share.steps == 3 and share.busy_s > 0
    assert share.fraction < 0.2  # the steps were queued back to back: the GPU never waited
