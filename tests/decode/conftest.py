"""Fixtures: the daemon tests' sample shards and their index rows
(``tests/feeder/conftest.py``), for the decode tests that run through a daemon, and a
lane of a pool of two workers for the finishing stage's tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from core.workers import FairPool, Lane
from tests.feeder.conftest import index_rows, shards

__all__ = ["index_rows", "lane", "shards"]


@pytest.fixture
def lane() -> Iterator[Lane]:
    """A lane of a pool of two workers, closed after the test."""
    workers = FairPool(2, name="t-finish")
    yield workers.lane("finish")
    workers.close()
