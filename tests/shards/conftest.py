"""Fixtures: real sample shards made by the sharder."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.shards import build_sample_shards


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("format-shards"))
