"""``feeder-s3``: ``feeder-shm`` with the dataset in an object store (``--store s3``).

The daemon serves ``STORE_URL/feeder`` (the bench's shards, uploaded there) with a
node-local shard cache in a fresh folder of every start, so a start's first epoch is
cold (ranged GETs merged per shard while each shard is fetched whole in the
background) and its later epochs read the cached shards with local ``pread``. Nothing
else differs from ``feeder-shm``: the same consumer, budget and transport.
"""

from __future__ import annotations

import tempfile
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.feeder_grpc import DATASET, daemon_options
from bench.loaders.feeder_grpc import open_loader as _open_loader
from bench.loaders.store_peers import FEEDER_PREFIX
from launcher.daemon_process import DaemonProcess

__all__ = ["CACHE_BYTES", "STORE_PREFIX", "open_loader", "open_shared"]

STORE_PREFIX = FEEDER_PREFIX
# The shard cache's budget: far above the bench's data, so nothing is evicted.
CACHE_BYTES = "64G"


@contextmanager
def open_shared(spec: LoaderSpec) -> Iterator[str]:
    """Starts ``feeder serve`` on the store's copy with an empty shard cache; yields
    its ``host:port``; stops it and removes the cache after.

    Raises:
        ValueError: the spec names no store (``--store s3`` not given).
    """
    if not spec.store_url:
        raise ValueError("feeder-s3 reads from an object store: run throughput.py with --store s3")
    with tempfile.TemporaryDirectory(prefix="feeder-shard-cache-") as cache:
        store = ("--s3-endpoint", spec.store_endpoint, "--cache-dir", str(Path(cache)), "--cache-bytes", CACHE_BYTES)
        with DaemonProcess({DATASET: f"{spec.store_url}/{STORE_PREFIX}"}, (*daemon_options(spec), *store),
                           die_with_parent=True) as daemon:
            yield daemon.address


def open_loader(spec: LoaderSpec, shared: object = None) -> AbstractContextManager[Iterator[Batch]]:
    """As ``feeder-shm``'s."""
    return _open_loader(spec, shared, transport="shm")
