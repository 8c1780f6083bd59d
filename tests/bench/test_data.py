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


@pytest.mark.slow
def test_a_sample_made_by_several_processes_has_every_image_once_numbered_as_one_would(tmp_path: Path) -> None:
    data = prepare_sample(tmp_path, train_per_class=5, workers=2)  # shares of 3 and 2 a class
    for wnid_dir in sorted((data.source / "train").iterdir()):
        names = sorted(p.name for p in wnid_dir.iterdir())
        assert names == sorted(f"{wnid_dir.name}_{n}.JPEG" for n in range(1, 6))
    images = [p.read_bytes() for p in (data.source / "train").rglob("*.JPEG")]
    assert len(set(images)) == 50  # each share from a seed of its own: no image twice
    assert sum(1 for _ in (data.source / "val").glob("*.JPEG")) == 100  # the validation images once
    manifest = read_manifest(data.shards)
    assert manifest.splits["train"].num_samples == 50 and manifest.splits["val"].num_samples == 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["sample-5"]  # no share left beside it
    assert sorted(p.name for p in (tmp_path / "sample-5").iterdir()) == ["shards", "src"]
