"""Smoke test of ``bench/throughput.py --store s3``: its own SeaweedFS, feeder from the
store and from local disk, and the store peers in their venvs, a few tiny batches.

Only that the run reads every loader's batches from the store it started, reports the
two epochs apart with the ratios and the store's raw bandwidth, and writes the JSON;
speed is measured by running the benchmark, never asserted here. A peer whose venv is
not made under the bench's cache is skipped (the test suite never makes one).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench import throughput
from bench.loaders import loader_module
from bench.venvs import is_made

PEERS = ("streaming", "webdataset-s3", "litdata")
IMAGE_SIZE_PX = 32
BATCH = 8


def _made_peers() -> list[str]:
    return [n for n in PEERS if is_made(loader_module(n).ENVIRONMENT, throughput.DEFAULT_CACHE)]


def _argv(shards: Path, loaders: list[str], out: Path, cache: Path = throughput.DEFAULT_CACHE) -> list[str]:
    return [
        "--store", "s3", "--data", str(shards), "--cache", str(cache), "--loaders", ",".join(loaders),
        "--image-size", str(IMAGE_SIZE_PX), "--batch-size", str(BATCH), "--threads", "2", "--json", str(out),
    ]


@pytest.mark.slow
def test_feeder_and_the_store_peers_read_the_store_the_run_started(tmp_path: Path, bench_shards: Path) -> None:
    peers = _made_peers()
    if not peers:
        pytest.skip(f"no store peer venv is made under {throughput.DEFAULT_CACHE} "
                    "(bench/throughput.py --store s3 makes them; the test suite never does)")
    loaders = ["feeder-s3", "feeder-shm", *peers]
    out = tmp_path / "result.json"

    code = throughput.main(_argv(bench_shards, loaders, out))

    doc = json.loads(out.read_text())
    rows = {r["loader"]: r for r in doc["results"]}
    assert code == 0 and list(rows) == loaders
    for name, row in rows.items():
        assert "error" not in row and "skipped" not in row, row
        assert row["problems"] == [] and row["epoch1_images_per_s"] > 0 and row["images_per_s"] > 0, name
        assert row["epoch1_x_best_peer"] > 0 and row["x_local"] > 0, name
    assert rows["feeder-shm"]["x_local"] == pytest.approx(1.0)
    assert max(rows[p]["epoch1_x_best_peer"] for p in peers) == pytest.approx(1.0)
    bandwidth = doc["config"]["raw_bandwidth"]
    assert bandwidth["mb_per_s_1"] > 0 and bandwidth["images_per_s_2"] > 0
    assert [t["ratio"] for t in doc["targets"]] == [0.97, 1.5, 0.8]
    assert doc["config"]["store"] == "s3" and doc["config"]["epochs"] == 2


@pytest.mark.slow
def test_feeder_from_the_store_alone_reports_both_epochs(tmp_path: Path, bench_shards: Path) -> None:
    out = tmp_path / "result.json"

    code = throughput.main(_argv(bench_shards, ["feeder-s3"], out, tmp_path / "cache"))

    (row,) = json.loads(out.read_text())["results"]
    assert code == 0 and row["problems"] == []
    assert row["epoch1_images_per_s"] > 0 and row["images_per_s"] > 0
    assert row["x_local"] is None  # feeder-shm was not in this run


def test_store_loaders_without_the_store_are_refused(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        throughput.parse_args(["--loaders", "feeder-shm,litdata"])
    err = capsys.readouterr().err
    assert "litdata" in err and "--store s3" in err
