"""``litdata``: LitData's StreamingDataset over its ``optimize`` output in the store, in a venv of its own.

``prepare`` runs ``litdata.optimize`` over the split (each sample the JPEG bytes of the
shard tars, not re-encoded, and the label; ``chunk_bytes="64MB"``, the size of its
README's examples), kept under ``CACHE``; the bench uploads the chunks to
``STORE_URL/litdata`` at every ``--store s3`` run.

What runs (LitData's README, "Stream data from cloud storage" and "Benchmarks", and
``src/litdata/streaming/dataset.py``): a ``StreamingDataset(input_dir=STORE_URL/litdata,
cache_dir=FRESH_DIR, shuffle=True, drop_last=True, storage_options={"endpoint_url": ...})``
whose ``__getitem__`` decodes and augments (the README's subclassing pattern), read by
a ``StreamingDataLoader`` with ``num_workers=threads`` (workers not persistent: with
``persistent_workers=True`` its epoch 2 ran at 0.4x its epoch 1 here, 2.5x the CPU per
image). Everything else is LitData's
default: ``max_pre_download=2`` chunks ahead per worker and a 100 GB cache, so epoch 2
reads only the chunks already downloaded. LitData fetches chunks with obstore, with
client options of its own that do not allow plain HTTP; ``allow_http`` is added to
them so it reaches the store's ``http://`` endpoint.
"""

from __future__ import annotations

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

__all__ = ["ENVIRONMENT", "STORE_PREFIX", "local_copy", "open_loader", "prepare", "samples_of"]

ENVIRONMENT = Environment(
    name="litdata",
    requirements=("litdata==0.2.76", *TORCH_REQUIREMENTS),
    check="import litdata, torchvision, boto3",
)
STORE_PREFIX = "litdata"
_ALL = 1 << 40


def local_copy(spec: LoaderSpec) -> Path:
    """The folder of chunks ``prepare`` writes (and the bench uploads)."""
    return local_dataset(spec, "litdata")


def samples_of(source: str) -> Iterator[dict[str, Any]]:
    """``optimize``'s function: every sample of ``"SHARDS|SPLIT"``, in write order."""
    shards, _, split = source.rpartition("|")
    for sample in read_samples(Path(shards), split, _ALL):
        yield {"jpg": sample.jpeg, "cls": sample.label}


def prepare(spec: LoaderSpec) -> None:
    """Writes the split with ``litdata.optimize`` under ``CACHE`` (once).

    Raises:
        FileNotFoundError / ValueError: ``spec.shards`` has no such split (see ``read_samples``).
    """
    from litdata import optimize

    def write(out: Path) -> None:
        optimize(fn=samples_of, inputs=[f"{spec.shards}|{spec.split}"], output_dir=str(out), chunk_bytes="64MB",
                 num_workers=1)

    built_once(local_copy(spec), write)


def _dataset(spec: LoaderSpec, cache: str) -> Any:
    from litdata import StreamingDataset

    dataset = augmented(StreamingDataset, spec.image_size_px)
    return dataset(store_root(spec, STORE_PREFIX), cache_dir=cache, shuffle=True, drop_last=True, seed=spec.seed,
                   storage_options={"endpoint_url": spec.store_endpoint})


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches streamed from the store's LitData chunks.

    Raises:
        ValueError: the spec names no store.
    """
    from litdata import StreamingDataLoader
    from litdata.streaming import downloader

    # LitData fetches chunks with obstore, whose client options it fixes: an http://
    # endpoint needs their allow_http (set before the workers fork and build the store).
    downloader._OBSTORE_CLIENT_OPTIONS["allow_http"] = True
    with tempfile.TemporaryDirectory(prefix="litdata-cache-", ignore_cleanup_errors=True) as cache:
        loader = StreamingDataLoader(_dataset(spec, cache), batch_size=spec.batch_size, num_workers=spec.threads,
                                     drop_last=True)
        yield batches(lambda: loader)
