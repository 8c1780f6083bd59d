"""Real sample shards and the JPEG tree they were made from, for the bench tests."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.shards import build_sample_shards, build_sample_tree


@pytest.fixture(scope="session")
def bench_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("bench")


@pytest.fixture(scope="session")
def bench_shards(bench_root: Path) -> Path:
    return build_sample_shards(bench_root)


@pytest.fixture(scope="session")
def bench_source(bench_root: Path, bench_shards: Path) -> Path:
    return build_sample_tree(bench_root)
