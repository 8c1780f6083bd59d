"""Which shards and JPEG tree a benchmark reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.data import prepare_sample, resolve
from shards.manifest import read_manifest


def test_the_source_defaults_to_the_tree_the_manifest_names(bench_shards: Path, bench_source: Path) -> None:
    assert resolve(bench_shards, None).source == bench_source.resolve()


def test_an_explicit_source_wins(bench_shards: Path, tmp_path: Path) -> None:
    assert resolve(bench_shards, tmp_path).source == tmp_path


def test_a_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="feeder shard"):
        resolve(tmp_path, None)


@pytest.mark.slow
def test_a_sample_of_another_size_is_made_in_a_folder_of_its_own(tmp_path: Path) -> None:
    data = prepare_sample(tmp_path, train_per_class=3)
    assert data.shards == tmp_path / "sample-3" / "shards"
    assert sum(1 for _ in (data.source / "train").rglob("*.JPEG")) == 30  # ten classes of three
    assert read_manifest(data.shards).splits["train"].num_samples == 30
    made = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert prepare_sample(tmp_path, train_per_class=3) == data
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == made  # made once
