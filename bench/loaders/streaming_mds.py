"""``streaming``: MosaicML Streaming over MDS shards in the store, in a venv of its own.

``prepare`` writes the split's JPEG bytes (the very bytes of the shard tars, not
re-encoded) and labels into MDS shards (``MDSWriter``, columns ``jpg: bytes`` and
``cls: int``, ``size_limit`` 64 MiB: the writer's default shard size), kept under
``CACHE``; the bench uploads them to ``STORE_URL/mds`` at every ``--store s3`` run.

What runs (Streaming's docs, docs.mosaicml.com/projects/streaming: "Dataset
configuration", "Performance tuning"; ``streaming/base/dataset.py``): a
``StreamingDataset(remote=..., local=FRESH_DIR, shuffle=True, batch_size=...)`` whose
``__getitem__`` decodes and augments (the documented subclassing pattern), read by a
``StreamingDataLoader`` with ``num_workers=threads``, ``drop_last``, persistent
workers and the DataLoader's default prefetch. Everything else is Streaming's default,
which its tuning guide gives as the fast configuration for one node: ``predownload``
8 x batch size per worker, ``py1e`` shuffle, no ``cache_limit`` (the whole split stays
in ``local``, so epoch 2 reads only local files). Shards come from the store with
Streaming's own boto3 downloader (``S3_ENDPOINT_URL`` points it at the store).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.store_peers import (
    TORCH_REQUIREMENTS,
    augmented,
    batches,
    built_once,
    local_dataset,
    store_root,
)
from bench.loaders.tar_samples import read_samples
from bench.venvs import Environment

__all__ = ["ENVIRONMENT", "STORE_PREFIX", "local_copy", "open_loader", "prepare"]

ENVIRONMENT = Environment(
    name="streaming",
    requirements=("mosaicml-streaming==0.13.0", *TORCH_REQUIREMENTS),
    check="import streaming, torchvision, boto3",
)
STORE_PREFIX = "mds"
_SHARD_BYTES = 1 << 26  # MDSWriter's default size_limit
_ALL = 1 << 40


def local_copy(spec: LoaderSpec) -> Path:
    """The MDS folder ``prepare`` writes (and the bench uploads)."""
    return local_dataset(spec, "mds")


def _write(spec: LoaderSpec, out: Path) -> None:
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"jpg": "bytes", "cls": "int"}, size_limit=_SHARD_BYTES) as writer:
        for sample in read_samples(spec.shards, spec.split, _ALL):
            writer.write({"jpg": sample.jpeg, "cls": sample.label})


def prepare(spec: LoaderSpec) -> None:
    """Writes the split as MDS shards under ``CACHE`` (once).

    Raises:
        FileNotFoundError / ValueError: ``spec.shards`` has no such split (see ``read_samples``).
    """
    built_once(local_copy(spec), lambda tmp: _write(spec, tmp))


def _dataset(spec: LoaderSpec, local: str) -> Any:
    from streaming import StreamingDataset

    dataset = augmented(StreamingDataset, spec.image_size_px)
    return dataset(remote=store_root(spec, STORE_PREFIX), local=local, shuffle=True, shuffle_seed=spec.seed,
                   batch_size=spec.batch_size)


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches streamed from the store's MDS shards.

    Raises:
        ValueError: the spec names no store.
    """
    from streaming import StreamingDataLoader
    from streaming.base.util import clean_stale_shared_memory

    os.environ["S3_ENDPOINT_URL"] = spec.store_endpoint
    clean_stale_shared_memory()
    with tempfile.TemporaryDirectory(prefix="streaming-cache-", ignore_cleanup_errors=True) as local:
        loader = StreamingDataLoader(_dataset(spec, local), batch_size=spec.batch_size, num_workers=spec.threads,
                                     drop_last=True, persistent_workers=True)
        yield batches(lambda: loader)
