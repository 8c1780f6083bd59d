"""Fixtures for the loader's tests: real sample shards and an in-process daemon on
port 0 (:mod:`tests.common.sample_daemon`)."""

from __future__ import annotations

from tests.common.sample_daemon import daemon, shards  # noqa: F401 - fixtures


