"""``bench/gpu_check.sh --rehearse``: the GPU check's steps, limits, output packing and
clean-up on the CPU, from a fresh copy of the tree (generated modules and sample data
made by the script), so the script is known to work before a GPU is lent."""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from bench.data import prepare_sample
from bench.proctree import kill_env, pids_with_env
from tests.common.env import ROOT

BUDGET_S = 300  # the rehearsal's, as the GPU's
OUTPUTS = ["gpu-tests.xml", "logs.txt", "summary.json", "summary.txt", "throughput-224.json", "train.json"]
STEPS = ["unpack", "machine", "protoc", "data", "throughput-224", "train", "gpu-tests"]


def _fresh_copy(tree: Path) -> None:
    """The working tree as a clone would have it: tracked and untracked files that git
    does not ignore (no generated modules, no built library, no caches)."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if name.split("/")[0] == ".venv" or not source.is_file():
            continue
        (tree / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, tree / name)


def _pack(folder: Path) -> Path:
    """A pack as bench/gpu_pack.sh makes them (an xz tar split in parts), of one module."""
    data = io.BytesIO()
    with tarfile.open(fileobj=data, mode="w:xz") as pack:
        module = b"CARRIED = True\n" + b"# padding\n" * 5000
        info = tarfile.TarInfo("feeder_carried_probe.py")
        info.size = len(module)
        pack.addfile(info, io.BytesIO(module))
    folder.mkdir()
    raw = data.getvalue()
    (folder / "part-aa").write_bytes(raw[: len(raw) // 2])
    (folder / "part-ab").write_bytes(raw[len(raw) // 2 :])
    return folder


@pytest.mark.cluster  # a whole rehearsal of the device check: make test-cluster
def test_the_rehearsal_ends_inside_its_budget_with_its_files_and_nothing_left_running(tmp_path: Path) -> None:
    tree, out, site, work = tmp_path / "tree", tmp_path / "out", tmp_path / "site", tmp_path / "tmp"
    _fresh_copy(tree)
    work.mkdir()
    mark = f"rehearsal-{os.getpid()}"
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "SITE": str(site), "TMPDIR": str(work),
           "FEEDER_TEST_RUN": mark}
    env.pop("BENCH_CACHE", None)
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "bench/gpu_check.sh", "--rehearse", "--site-parts", str(_pack(tmp_path / "p"))],
                              cwd=tree, env=env, capture_output=True, text=True, timeout=BUDGET_S + 60)
        elapsed_s = time.monotonic() - started
        left = pids_with_env("FEEDER_TEST_RUN", mark)
    finally:
        kill_env("FEEDER_TEST_RUN", mark)
    logs = (out / "logs.txt").read_text(errors="replace") if (out / "logs.txt").exists() else ""
    assert done.returncode == 0, done.stdout + done.stderr + logs[-3000:]
    assert elapsed_s < BUDGET_S + 10  # the script cuts its steps to its budget
    assert left == []  # no worker, daemon or sampler outlived the run
    assert sorted(p.name for p in out.rglob("*")) == OUTPUTS  # at most 8 files, no folders
    assert done.stdout == (out / "summary.txt").read_text()  # the summary is all there is on the screen
    assert done.stdout.startswith("== feeder GPU check (rehearsal) on no CUDA device (no GPU): ok")
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == STEPS and {s["status"] for s in summary["steps"]} == {"ok"}
    limits = {s["name"]: s["limit_s"] for s in summary["steps"]}
    assert sum(limits.values()) <= BUDGET_S - 15 - 10  # the summary's time and a margin kept back
    assert summary["kind"] == "no GPU" and "window decoder: " in done.stdout  # a clone builds no decoder: said
    for size in summary["sizes"]:
        assert size["daemon_loader"] == "feeder-shm" and size["errors"] == {}
        assert size["daemon_images_per_s"] > 0 and size["inprocess_images_per_s"] > 0 and size["gpu_host_copies"] == 0
    variants = summary["train"]["variants"]
    assert set(variants) == {"split", "cpu"} and summary["train"]["complete"]  # each daemon against synthetic
    for variant in variants.values():
        assert set(variant["sizes"]) == {"32", "24"} and variant["projected_minutes"] > 0
        assert all(0 < f["feeder_over_synthetic"] and f["windows"] == 2 for f in variant["sizes"].values())
    assert "trainer step, ms, fed by each daemon" in done.stdout and "n/a on the CPU" in done.stdout
    assert "an upper bound" in done.stdout  # the projection says what it is
    assert summary["tests"] and {t["outcome"] for t in summary["tests"]} == {"skipped"}  # no CUDA here
    assert (site / "feeder_carried_probe.py").is_file() and "===== unpack: ok" in logs
    assert list(work.iterdir()) == []  # its work folder (and the sample data in it) is gone


@pytest.mark.cluster
def test_a_step_at_its_limit_is_killed_with_everything_it_started_keeping_what_it_finished(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    prepare_sample(cache, train_per_class=8)  # so that the budget runs out in the trainer's step
    # 110 s: the deadline (95 s) cuts the trainer's limit however fast the steps before it
    # ran, so the budget runs out in it and nothing is left for the tests
    out, mark, budget_s = tmp_path / "out", f"cut-{os.getpid()}", 110
    env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "BENCH_CACHE": str(cache),
           "BUDGET_S": str(budget_s), "TRAIN_REPEATS": "1000",  # a step that cannot finish
           "FEEDER_TEST_RUN": mark}
    started = time.monotonic()
    try:
        done = subprocess.run(["bash", "bench/gpu_check.sh", "--rehearse"], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=budget_s + 60)
        elapsed_s = time.monotonic() - started
        left = pids_with_env("FEEDER_TEST_RUN", mark)
    finally:
        kill_env("FEEDER_TEST_RUN", mark)
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s["status"] for s in summary["steps"]}
    assert done.returncode == 1 and "step(s) not ok" in done.stdout.splitlines()[0]
    assert elapsed_s < budget_s + 10 and left == []
    assert steps["train"] == "killed at its limit", steps  # its daemons and ranks ran in sessions of their own
    assert steps["gpu-tests"] == "skipped (budget)"
    assert summary["train"]["complete"] is False and set(summary["train"]["variants"]) == {"split", "cpu"}
    assert "(cut short: the windows that finished)" in done.stdout  # written as it went
