"""Fixtures for the loader's tests: real sample shards and an in-process daemon on
port 0 (:mod:`tests.common.sample_daemon`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.common.sample_daemon import build_client_shards, start_daemon


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_client_shards(tmp_path_factory.mktemp("client-shards"))


@pytest.fixture(scope="module")
def daemon(shards: Path) -> Iterator[str]:
    server, port = start_daemon(shards)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)
