"""A real S3 server for the tests (SeaweedFS, :mod:`bench.seaweedfs`), started once per
session by the ``s3_server`` fixture (``tests/conftest.py``), and fresh buckets on it."""

from __future__ import annotations

import itertools
import os

from bench.seaweedfs import SeaweedFS

__all__ = ["fresh_bucket"]

_buckets = itertools.count()


def fresh_bucket(server: SeaweedFS, stem: str = "t") -> str:
    """The name of a new, empty bucket on ``server`` (created), unique in this session."""
    name = f"{stem}-{os.getpid()}-{next(_buckets)}".lower()
    server.filesystem().create_dir(name)
    return name
