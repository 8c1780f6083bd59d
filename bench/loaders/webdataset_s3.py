"""``webdataset-s3``: WebDataset over feeder's own shard tars in the store, in a venv of its own.

What runs (WebDataset's docs, "Creating a dataset" / "Remote storage" and
``webdataset/compat.py``): ``wds.WebDataset(urls, shardshuffle=len(urls),
cache_dir=FRESH_DIR, select_files=...)`` where each URL is ``pipe:PYTHON -m
bench.loaders.s3_cat s3://.../shard.tar`` (the documented way to read from a store: a
command streaming the shard to stdout, here boto3), shards split between the
DataLoader workers, a 1,000-sample shuffle buffer, PIL decoding and the ``torchvision``
loader's transforms in the workers, batched there (``batched(batch, partial=False)``),
read by ``wds.WebLoader(batch_size=None, num_workers=threads)`` (``empty_check=False``: a
worker may get no shard of a split with fewer tars than workers). ``cache_dir`` is
WebDataset's shard cache: epoch 1 downloads each tar whole into it before reading it,
epoch 2 reads the cached files. The half-scale copies feeder keeps in the tars
(``.half.jpg``) are left out by ``select_files`` (their bytes still come over the
network: they are part of the tars).
"""

from __future__ import annotations

import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.store_peers import FEEDER_PREFIX, TORCH_REQUIREMENTS, batches, store_root, train_transform
from bench.loaders.tar_samples import split_tars
from bench.venvs import Environment

__all__ = ["ENVIRONMENT", "open_loader", "shard_urls"]

ENVIRONMENT = Environment(
    name="webdataset",
    requirements=("webdataset==1.0.2", *TORCH_REQUIREMENTS),
    check="import webdataset, torchvision, boto3",
)
_SHUFFLE_BUFFER = 1000


def shard_urls(spec: LoaderSpec) -> list[str]:
    """The ``pipe:`` URLs of the split's tars in the store."""
    root = store_root(spec, FEEDER_PREFIX)
    tars = split_tars(spec.shards, spec.split)
    return [f"pipe:{sys.executable} -m bench.loaders.s3_cat {root}/{path}" for path in tars]


def _wanted(name: str) -> bool:
    return not name.endswith(".half.jpg")


def _loader(spec: LoaderSpec, cache: str) -> Any:
    import webdataset as wds

    urls = shard_urls(spec)
    dataset = (
        wds.WebDataset(urls, shardshuffle=len(urls), cache_dir=cache, seed=spec.seed, select_files=_wanted,
                      empty_check=False)
        .shuffle(_SHUFFLE_BUFFER)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(train_transform(spec.image_size_px), int)
        .batched(spec.batch_size, partial=False)
    )
    return wds.WebLoader(dataset, batch_size=None, num_workers=spec.threads, persistent_workers=True)


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches of the store's tars.

    Raises:
        ValueError: the spec names no store.
    """
    with tempfile.TemporaryDirectory(prefix="webdataset-cache-", ignore_cleanup_errors=True) as cache:
        loader = _loader(spec, cache)
        yield batches(lambda: loader)
