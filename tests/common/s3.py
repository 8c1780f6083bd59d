"""A real S3 server for the tests (SeaweedFS, :mod:`bench.seaweedfs`), started once per
session by the ``s3_server`` fixture (``tests/conftest.py``), fresh buckets on it,
shard directories copied there, and the environment that points clients at it."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.seaweedfs import SeaweedFS
from shards.objects import ObjectUrl
from shards.store import ObjectStore, StoreOptions

__all__ = ["fresh_bucket", "pointed_at", "store_of", "upload_tree"]

_buckets = itertools.count()


def fresh_bucket(server: SeaweedFS, stem: str = "t") -> str:
    """The name of a new, empty bucket on ``server`` (created), unique in this session."""
    name = f"{stem}-{os.getpid()}-{next(_buckets)}".lower()
    server.filesystem().create_dir(name)
    return name


@contextmanager
def pointed_at(server: SeaweedFS, **changes: str) -> Iterator[None]:
    """The standard AWS variables set for ``server`` (``changes`` on top) while the
    block runs, the previous ones back afterwards."""
    wanted = server.environment() | changes
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def store_of(server: SeaweedFS, url: str, **options: float) -> ObjectStore:
    """An ObjectStore rooted at ``url`` on ``server`` (its identity, no retries unless asked)."""
    with pointed_at(server):
        return ObjectStore(ObjectUrl.parse(url), StoreOptions(endpoint_url=server.endpoint_url, **options))


def upload_tree(server: SeaweedFS, local: Path, url: str) -> str:
    """Every file under ``local`` copied to ``url`` (``s3://bucket/prefix``), the
    manifest last; returns ``url``."""
    store = store_of(server, url)
    files = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: p.name == "manifest.json")
    for path in files:
        store.put_file(path.relative_to(local).as_posix(), path)
    return url
