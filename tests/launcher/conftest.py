"""The node both ``feeder run`` modules launch on: the sample shards (per module) and
a node's folders and environment around them (per test)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.common.launcher_runs import node_of
from tests.common.shards import build_sample_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("run-shards"), classes=4, train_per_class=24,
                               val_per_class=4)


@pytest.fixture()
def node(tmp_path: Path, shards: Path) -> Iterator[dict]:
    with node_of(tmp_path, shards) as found:
        yield found
