"""Fixtures: the daemon tests' sample shards and their index rows
(``tests/feeder/conftest.py``), for the decode tests that run through a daemon."""

from __future__ import annotations

from tests.feeder.conftest import index_rows, shards

__all__ = ["index_rows", "shards"]
