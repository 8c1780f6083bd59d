"""The trainer bench (``bench/train.py``): its projection of a schedule's time from
per-size rates, its figures from timed windows, a daemon slower than the step read as
slow however long it had to fill its ring before its windows, and (a whole recipe,
``cluster``) a run on the CPU with two daemons and torchrun ranks."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from bench.cpu_quota import CpuQuota
from bench.train_figures import Window, summarise
from bench.train_projection import project
from tests.common.env import ROOT, child_env


def test_the_projection_of_imagenet_fastai_from_the_h200s_synthetic_rates() -> None:
    # A plain ResNet-50 step on an H200: 4,685 images/s at 224 px, 13,694 at 128 px;
    # 288 px is scaled from 224 by pixel count: 12.2 min on 8 GPUs with no stall.
    projection = project({128: 13_694.0, 224: 4_685.0})
    assert projection.minutes == pytest.approx(12.19, abs=0.01)
    by_size = {p.image_size: p for p in projection.phases}
    assert by_size[288].measured_at == 224 and by_size[288].images_per_s_per_gpu == pytest.approx(2834, abs=1)
    assert sum(p.epochs for p in projection.phases) == 28
    assert "scaled from 224 px" in projection.line() and "12.2 min" in projection.line()
    with pytest.raises(ValueError):
        project({})


def _window(source: str, size: int, repeat: int, seconds: float, idle: float = 0.0,
            jpeg: float | None = None) -> Window:
    return Window(source, size, repeat, steps=20, images=20 * 256, seconds=seconds, idle_fraction=idle,
                  stall_fraction=0.0, gpu_percent=99.0, jpeg_percent=jpeg, counters="nvml",
                  transport="" if source == "synthetic" else "cuda_ipc")


def test_each_daemons_ratio_is_the_synthetic_step_time_over_its_own_with_the_spread_of_the_rounds() -> None:
    windows = [_window("synthetic", 224, 0, 1.00, idle=0.01), _window("split", 224, 0, 1.05, idle=0.02, jpeg=40.0),
               _window("split", 224, 1, 1.10, idle=0.04, jpeg=30.0), _window("synthetic", 224, 1, 1.00, idle=0.01),
               _window("synthetic", 224, 2, 1.02, idle=0.01), _window("split", 224, 2, 1.02, idle=0.03, jpeg=35.0),
               _window("synthetic", 128, 0, 0.5), _window("split", 128, 0, 0.5)]
    figures = summarise(windows, ["split", "cpu"], cores=16)
    at_224 = figures["variants"]["split"]["sizes"]["224"]
    assert at_224["feeder_step_ms"] == pytest.approx(52.5) and at_224["synthetic_step_ms"] == pytest.approx(50.0)
    assert at_224["feeder_over_synthetic"] == pytest.approx(50.0 / 52.5)
    assert at_224["ratio_range"] == pytest.approx([1.00 / 1.10, 1.02 / 1.02])  # each round against its own
    assert at_224["idle_fed_minus_synthetic"] == pytest.approx(0.02) and at_224["jpeg_percent"] == 35.0
    assert at_224["windows"] == 3 and at_224["feeder_images_per_s"] == pytest.approx(20 * 256 / 1.05)
    assert set(figures["variants"]) == {"split"}  # a daemon with no window yet: not reported
    assert figures["variants"]["split"]["transport"] == "cuda_ipc"
    assert "all 16 cores of this machine, times 8: an upper bound" in figures["projection_basis"]
    assert "2 each" in figures["projection_basis"] and len(figures["windows"]) == 8


def _quota_or_skip() -> None:
    try:
        CpuQuota(f"feeder-test-probe-{os.getpid()}", 0.5).remove()
    except OSError as e:
        pytest.skip(f"no cgroup to hold a daemon to a share of a core: {e}")


@pytest.mark.slow
@pytest.mark.serial  # compares the step's rate fed and on synthetic data
def test_a_daemon_slower_than_the_step_reads_slow_though_it_had_time_to_fill_its_ring(tmp_path: Path) -> None:
    # The daemon held to 2 % of a core makes a batch of 16 in about 0.5 s, the step
    # takes 0.05-0.4 s; before each window the trainer stands idle 3 s, as validation
    # and a checkpoint do between epochs, in which a stream kept open would fill its
    # ring with the settle step's and the window's 4 batches (they then read as fast as
    # synthetic data: 1.2-1.7x on this machine, as the bench measured whole epochs
    # with validation between them). Dropped after each window, the stream's ring
    # starts empty: 0.14x here.
    _quota_or_skip()
    out = tmp_path / "train.json"
    done = subprocess.run(
        [sys.executable, "bench/train.py", "--daemon-device", "cpu", "--nproc", "1", "--sizes", "16",
         "--batch-size", "16", "--window-steps", "3", "--settle-steps", "1", "--warmup-steps", "1", "--repeats", "1",
         "--pause-s", "3", "--daemon-cpus", "0.02", "--threads", "1", "--skip-accuracy", "--variant", "slow=",
         "--cache", str(tmp_path / "cache"), "--images-per-class", "8", "--json", str(out)],
        cwd=ROOT, env=child_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["results"][0]["throughput"]
    slow = figures["variants"]["slow"]["sizes"]["16"]
    assert slow["feeder_over_synthetic"] < 0.8, slow
    assert figures["complete"] and len(figures["windows"]) == 2


@pytest.mark.cluster
def test_the_bench_runs_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "train.json"
    done = subprocess.run(
        [sys.executable, "bench/train.py", "--daemon-device", "cpu", "--nproc", "2", "--sizes", "48,32",
         "--batch-size", "8", "--window-steps", "4", "--settle-steps", "2", "--warmup-steps", "2", "--repeats", "2",
         "--skip-accuracy", "--threads", "2", "--cache", str(tmp_path / "cache"), "--images-per-class", "20",
         "--json", str(out), "--variant", "window=--cpu-decoder libjpeg-turbo", "--variant", "dali=--cpu-decoder dali"],
        cwd=ROOT, env=child_env() | {"OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    figures = json.loads(out.read_text())["results"][0]["throughput"]
    assert figures["complete"] and set(figures["variants"]) == {"window", "dali"}
    for variant in figures["variants"].values():
        assert set(variant["sizes"]) == {"48", "32"} and variant["transport"] == "shm"
        for sized in variant["sizes"].values():
            assert sized["windows"] == 2 and sized["feeder_step_ms"] > 0 and 0 <= sized["feeder_idle_fraction"] <= 1
            assert sized["jpeg_percent"] is None and "the trainer runs on the CPU" in sized["counters"]
        assert variant["projected_minutes"] > 0
    steps = {(w["source"], w["size"]): w["steps"] for w in figures["windows"]}
    assert steps[("synthetic", 48)] == 4 and steps[("synthetic", 32)] == 9  # scaled by pixel count
    assert done.stdout.count("projected imagenet-fastai on 8 GPUs") == 2 and "an upper bound" in done.stdout
