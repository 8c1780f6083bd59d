"""bench/shard.py runs end to end and writes its JSON document and PNG."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.shard import main


@pytest.mark.slow
def test_bench_writes_figures_config_and_revision(tmp_path: Path) -> None:
    args = ["--cache", str(tmp_path), "--classes", "2", "--train-per-class", "4", "--val-per-class", "1",
            "--workers", "1,2", "--pair", "--modes", "copy,passthrough", "--repeats", "2",
            "--json", str(tmp_path / "shard.json"), "--plot", str(tmp_path / "shard.png")]  # fmt: skip
    rows = main(args)
    document = json.loads((tmp_path / "shard.json").read_text())
    runs = [(r["mode"], r["workers"], r["images"]) for r in document["results"]]
    assert runs == [("copy", 1, 10), ("passthrough", 1, 10), ("passthrough", 2, 10), ("passthrough", "pair of 1", 20)]
    assert all(
        len(r["seconds"]) == len(r["cpu_seconds"]) == 2 and r["images_per_s"] > 0 and r["cpu_ms_per_image"] > 0
        for r in rows
    )
    assert "revision" in document["git"] and document["config"]["repeats"] == 2
    assert (tmp_path / "shard.png").read_bytes()[:4] == b"\x89PNG"


def test_bench_compares_the_tars_with_their_tree(tmp_path: Path) -> None:
    args = ["--cache", str(tmp_path), "--classes", "2", "--train-per-class", "4", "--val-per-class", "1",
            "--workers", "1", "--modes", "copy,passthrough", "--sources", "tree,tars", "--repeats", "1"]
    rows = main(args)
    assert [(r["mode"], r["source"], r["images"]) for r in rows] == [
        ("copy", "tree", 10), ("passthrough", "tree", 10), ("passthrough", "tars", 10)]
    assert rows[2]["over_tree"] == rows[2]["images_per_s"] / rows[1]["images_per_s"] > 0
