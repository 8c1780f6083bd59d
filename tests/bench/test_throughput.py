"""Smoke test of ``bench/throughput.py``: every loader, a few batches, tiny images.

Only that each loader runs and produces the right batches, and that the JSON and the
PNG come out; speed is measured by running the benchmark, never asserted here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from bench import throughput
from bench.loaders import LoaderSpec, loader_module
from bench.measure import Schedule
from bench.proctree import kill_env, pids_with_env
from bench.venvs import is_made
from tests.common.env import ROOT, child_env
from tests.common.waiting import wait_for

SMOKE_LOADERS = ["feeder-shm", "feeder-grpc", "inprocess", "torchvision", "webdataset", "decode-only", "synthetic"]
IMAGE_SIZE_PX = 32
BATCH = 8
THREADS = 2

ROW_KEYS = {
    "loader", "images_per_s", "images_per_s_repeats", "cpu_s_per_image", "peak_pss_bytes", "peak_rss_bytes",
    "setup_s", "batches", "problems", "cpus", "clients", "per_client_images_per_s", "client_spread",
    "x_torchvision", "x_decode_only", "x_inprocess", "x_tfdata", "load_average_1m", "starts", "cpus_busy",
}


def _run(
    tmp_path: Path, shards: Path, source: Path, loaders: list[str], clients: int = 1, split: str = "train"
) -> tuple[int, dict]:
    out = tmp_path / "result.json"
    argv = [
        "--data", str(shards), "--split", split, "--source", str(source), "--loaders", ",".join(loaders),
        "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH), "--threads", str(THREADS),
        "--seconds", "0.3", "--warmup", "0.1", "--repeats", "1", "--clients", str(clients),
        "--json", str(out), "--plot", str(tmp_path / "result.png"),
    ]
    code = throughput.main(argv)
    return code, json.loads(out.read_text())


@pytest.mark.slow
def test_every_loader_delivers_uint8_batches_and_the_run_is_recorded(
    tmp_path: Path, bench_shards: Path, bench_source: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Two consumers of the daemon; the loaders without a daemon ignore --clients.
    code, doc = _run(tmp_path, bench_shards, bench_source, SMOKE_LOADERS, clients=2)

    rows = {r["loader"]: r for r in doc["results"]}
    assert list(rows) == SMOKE_LOADERS
    for name, row in rows.items():
        assert "error" not in row, f"{name}: {row.get('error')}"
        assert row["problems"] == [], f"{name}: {row['problems']}"
        assert set(row) == ROW_KEYS | ({"daemon"} if name.startswith("feeder") else set()), name
        assert row["batches"] >= 2 and row["images_per_s"] > 0, name
        assert row["cpus"] == sorted(os.sched_getaffinity(0))[:THREADS], "the thread budget pins that many CPUs"
        assert row["peak_pss_bytes"] > 0
    assert code == 0
    for feeder in ("feeder-shm", "feeder-grpc"):
        assert rows[feeder]["clients"] == 2 and len(rows[feeder]["per_client_images_per_s"]) == 2
        daemon = rows[feeder]["daemon"]  # its counters: batches made on the CPU
        assert daemon["images_served"] >= rows[feeder]["batches"] * BATCH and daemon["gpu_host_copies"] == 0
    assert rows["inprocess"]["clients"] == 1
    assert rows["torchvision"]["x_torchvision"] == pytest.approx(1.0)
    assert rows["decode-only"]["x_decode_only"] == pytest.approx(1.0)
    assert doc["schema_version"] == 1
    assert [t["peer"] for t in doc["targets"]] == ["inprocess", "torchvision"]  # tfdata is not in this run
    assert doc["config"]["image_size_px"] == IMAGE_SIZE_PX and doc["config"]["loaders"] == SMOKE_LOADERS
    assert doc["machine"]["cores"] >= 1 and doc["machine"]["cpu_model"]
    assert len(doc["git"]["revision"] or "") == 40
    assert (tmp_path / "result.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    table = capsys.readouterr().out
    assert all(name in table for name in SMOKE_LOADERS)


@pytest.mark.slow
def test_a_failing_loader_is_reported_and_fails_the_run(tmp_path: Path, bench_shards: Path, bench_source: Path) -> None:
    code, doc = _run(tmp_path, bench_shards, bench_source, ["decode-only"], split="no-such-split")

    (failed,) = doc["results"]
    assert code == 1
    assert "no-such-split" in failed["error"] and "images_per_s" not in failed


def test_bad_options_are_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(["--loaders", "torchvision,pytorch-lightning"])
    assert "pytorch-lightning" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--threads", "0"])
    with pytest.raises(SystemExit):
        throughput.parse_args(["--images-per-class", "0"])
    assert "--images-per-class" in capsys.readouterr().err


def test_a_folder_without_shards_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert throughput.main(["--data", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0


def test_jobs_and_clients_together_and_a_single_epoch_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(["--jobs", "2", "--clients", "2"])
    assert "--jobs" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        throughput.parse_args(["--epochs", "1"])


@pytest.mark.slow
def test_two_jobs_with_the_decoded_cache_report_epochs_apart(
    tmp_path: Path, bench_shards: Path, bench_source: Path
) -> None:
    out = tmp_path / "result.json"
    argv = [
        "--data", str(bench_shards), "--source", str(bench_source), "--loaders", "feeder-grpc",
        "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH), "--threads", str(THREADS),
        "--jobs", "2", "--epochs", "3", "--decoded-cache-bytes", "64M", "--decoded-cache-side", "48",
        "--json", str(out),
    ]
    assert throughput.main(argv) == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["problems"] == [] and row["clients"] == 2
    assert row["epoch1_images_per_s"] > 0 and row["images_per_s"] > 0


@pytest.mark.slow
def test_tfdata_runs_or_is_skipped_with_its_reason(tmp_path: Path, bench_shards: Path, bench_source: Path) -> None:
    code, doc = _run(tmp_path, bench_shards, bench_source, ["tfdata"])
    (row,) = doc["results"]
    assert code == 0
    if "skipped" in row:  # tensorflow is optional
        assert "tensorflow" in row["skipped"] and "\n" not in row["skipped"]
    else:
        assert row["problems"] == [] and row["images_per_s"] > 0


@pytest.mark.slow
def test_a_loader_whose_package_is_not_installed_is_skipped_with_one_line(
    tmp_path: Path, bench_shards: Path, bench_source: Path
) -> None:
    # As after `pip install .` without the bench's extras: torchvision is not there.
    blocked = tmp_path / "without-torchvision" / "torchvision"
    blocked.mkdir(parents=True)
    (blocked / "__init__.py").write_text('raise ModuleNotFoundError("No module named \'torchvision\'", '
                                         'name="torchvision")\n')
    out = tmp_path / "result.json"
    env = child_env()
    env["PYTHONPATH"] = os.pathsep.join([str(blocked.parent), env["PYTHONPATH"]])
    done = subprocess.run(
        [sys.executable, "bench/throughput.py", "--data", str(bench_shards), "--source", str(bench_source),
         "--loaders", "torchvision,inprocess", "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH),
         "--threads", str(THREADS), "--seconds", "0.3", "--warmup", "0.1", "--repeats", "1", "--json", str(out)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-3000:]
    rows = {r["loader"]: r for r in json.loads(out.read_text())["results"]}
    assert "needs the package 'torchvision'" in rows["torchvision"]["skipped"]
    assert "\n" not in rows["torchvision"]["skipped"] and rows["inprocess"]["images_per_s"] > 0


def _stand_in_environment(cache: Path, name: str) -> None:
    """``cache/venv-<name>`` made as a plain interpreter without the peer's packages."""
    env = loader_module(name).ENVIRONMENT
    python = cache / f"venv-{name}" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f'#!/bin/sh\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    (python.parent.parent / "bench-environment.json").write_text(env.stamp())


def test_a_peer_its_interpreter_cannot_import_is_skipped_with_one_line(
    tmp_path: Path, bench_shards: Path, bench_source: Path
) -> None:
    for name in ("ffcv", "spdl"):
        _stand_in_environment(tmp_path / "cache", name)
    out = tmp_path / "result.json"
    argv = [
        "--data", str(bench_shards), "--source", str(bench_source), "--cache", str(tmp_path / "cache"),
        "--loaders", "ffcv,spdl", "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH),
        "--threads", str(THREADS), "--seconds", "0.3", "--warmup", "0.1", "--repeats", "1", "--json", str(out),
    ]

    code = throughput.main(argv)

    rows = {r["loader"]: r for r in json.loads(out.read_text())["results"]}
    assert code == 0 and list(rows) == ["ffcv", "spdl"]
    assert "ffcv cannot be imported here" in rows["ffcv"]["skipped"]  # its prepare step, in that interpreter
    assert "spdl cannot be used here" in rows["spdl"]["skipped"]
    assert all("\n" not in r["skipped"] and "images_per_s" not in r for r in rows.values())


def test_a_worker_whose_interpreter_is_gone_is_a_failure_naming_it(tmp_path: Path, bench_shards: Path) -> None:
    spec = LoaderSpec(shards=bench_shards, source=None, batch_size=BATCH, image_size_px=IMAGE_SIZE_PX)
    gone = str(tmp_path / "venv-x" / "bin" / "python")

    run = throughput.run_loader("synthetic", spec, Schedule(warmup_s=0, seconds=0.1, repeats=1), tmp_path, gone)

    assert gone in run["result"]["error"] and run["memory"]["peak_pss_bytes"] == 0


@pytest.mark.slow
def test_ffcv_and_spdl_run_in_their_venvs_beside_inprocess(tmp_path: Path) -> None:
    missing = [n for n in ("ffcv", "spdl") if not is_made(loader_module(n).ENVIRONMENT, throughput.DEFAULT_CACHE)]
    if missing:
        pytest.skip(f"the {' and '.join(missing)} venvs are not made under {throughput.DEFAULT_CACHE} "
                    "(bench/throughput.py --loaders ffcv,spdl makes them; the test suite never does)")
    out = tmp_path / "result.json"

    code = throughput.main(["--loaders", "ffcv,spdl,inprocess", "--seconds", "1", "--repeats", "1", "--json", str(out)])

    rows = {r["loader"]: r for r in json.loads(out.read_text())["results"]}
    assert code == 0
    for name in ("ffcv", "spdl", "inprocess"):
        assert "error" not in rows[name] and "skipped" not in rows[name], rows[name]
        assert rows[name]["problems"] == [] and rows[name]["images_per_s"] > 0


@pytest.mark.slow
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGKILL])
def test_workers_and_their_daemon_go_with_the_bench_however_it_is_stopped(bench_shards: Path, signum: int) -> None:
    mark = f"throughput-{os.getpid()}-{signum}"
    argv = [sys.executable, "bench/throughput.py", "--data", str(bench_shards), "--loaders", "feeder-grpc",
            "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH), "--threads", "1", "--seconds", "600"]
    bench = subprocess.Popen(argv, cwd=ROOT, env=child_env(FEEDER_TEST_RUN=mark), stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL)
    try:
        # The worker (a session of its own) and its daemon are running.
        assert wait_for(lambda: len(pids_with_env("FEEDER_TEST_RUN", mark)) >= 3, timeout_s=120)
        bench.send_signal(signum)
        bench.wait(30)
        assert wait_for(lambda: pids_with_env("FEEDER_TEST_RUN", mark) == [], timeout_s=30)
    finally:
        if bench.poll() is None:
            bench.kill()
        kill_env("FEEDER_TEST_RUN", mark)
