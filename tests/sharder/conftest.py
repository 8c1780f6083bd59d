"""Fixtures of the sharder's tests of OUT (a run killed part-way, a full disk, a
second run, an upload): the small sample tree they shard and what uninterrupted runs
make of it, made once for all the workers of a run (they only read them)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sharder import ShardConfig, shard
from tests.common.shards import build_sample_tree
from tests.common.shared import made_once
from tests.sharder.runs import SHARD_BYTES

_TREE = dict(classes=3, train_per_class=12, val_per_class=2)


@pytest.fixture(scope="session")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample tree (3 classes: 36 train images, 6 val): tests must not change it."""
    folder = made_once(tmp_path_factory, "sharder-tree", lambda path: build_sample_tree(path, **_TREE))
    return build_sample_tree(folder, **_TREE)  # its path, made already


def _reference(tmp_path_factory: pytest.TempPathFactory, src: Path, formats: tuple[str, ...]) -> Path:
    def make(out: Path) -> None:
        shard(ShardConfig(src, out, formats=formats, seed=7, shard_size_bytes=SHARD_BYTES))

    return made_once(tmp_path_factory, f"sharder-reference-{'-'.join(formats)}-s7-{SHARD_BYTES}", make)


@pytest.fixture(scope="session")
def reference(tmp_path_factory: pytest.TempPathFactory, src: Path) -> Path:
    """``src`` sharded uninterrupted into WebDataset tars and LMDB (seed 7, four train tars)."""
    out = _reference(tmp_path_factory, src, ("wds", "lmdb"))
    assert len(list((out / "train").glob("*.tar"))) == 4
    return out


@pytest.fixture(scope="session")
def wds_reference(tmp_path_factory: pytest.TempPathFactory, src: Path) -> Path:
    """``src`` sharded uninterrupted into WebDataset tars alone (seed 7)."""
    return _reference(tmp_path_factory, src, ("wds",))
