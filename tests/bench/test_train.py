"""The trainer bench (``bench/train.py``): its projection of a schedule's time from
per-size rates, its per-size figures from a trainer summary, and (a whole recipe,
``cluster``) a run on the CPU with a daemon and torchrun ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from bench.train import phase_figures
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


def test_each_sizes_figures_leave_its_first_epoch_out_and_count_per_rank() -> None:
    records = [{"image_size": 128, "images_per_s": v, "idle_fraction": i, "stall_fraction": 0.0}
               for v, i in ((10.0, 0.9), (400.0, 0.1), (600.0, 0.3))]
    records.append({"image_size": 224, "images_per_s": 50.0, "stall_fraction": 0.5})  # a phase of one epoch
    figures = phase_figures({"records": records}, nproc=2)
    assert figures[128] == {"images_per_s": 250.0, "idle_fraction": pytest.approx(0.2), "stall_fraction": 0.0}
    assert figures[224] == {"images_per_s": 25.0, "idle_fraction": 0.0, "stall_fraction": 0.5}


@pytest.mark.cluster
def test_the_bench_runs_on_the_cpu(tmp_path) -> None:
    out = tmp_path / "train.json"
    done = subprocess.run(
        [sys.executable, "bench/train.py", "--daemon-device", "cpu", "--nproc", "2", "--sizes", "32,48",
         "--epochs-per-size", "2", "--batch-size", "8", "--repeats", "1", "--skip-accuracy", "--threads", "2",
         "--cache", str(tmp_path / "cache"), "--images-per-class", "20", "--json", str(out),
         "--variant", "window=--cpu-decoder libjpeg-turbo", "--variant", "dali=--cpu-decoder dali"],
        cwd=ROOT, env=child_env(), capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(out.read_text())["results"][0]["throughput"]["variants"]
    assert set(result) == {"window", "dali"}
    for variant in result.values():
        assert set(variant["sizes"]) == {"32", "48"} and variant["transport"] == "shm"
        for figures in variant["sizes"].values():
            assert figures["feeder_images_per_s"] > 0 and 0 <= figures["feeder_idle_fraction"] <= 1
        assert variant["projected_minutes"] > 0
    assert done.stdout.count("projected imagenet-fastai on 8 GPUs") == 2
