"""Which shards and JPEG tree a benchmark reads."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.data import resolve


def test_the_source_defaults_to_the_tree_the_manifest_names(bench_shards: Path, bench_source: Path) -> None:
    assert resolve(bench_shards, None).source == bench_source.resolve()


def test_an_explicit_source_wins(bench_shards: Path, tmp_path: Path) -> None:
    assert resolve(bench_shards, tmp_path).source == tmp_path


def test_a_folder_without_manifest_is_refused(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="feeder shard"):
        resolve(tmp_path, None)
