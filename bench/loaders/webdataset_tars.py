"""``webdataset``: stock ``webdataset`` over the shard tars, torchvision transforms, DataLoader.

The pattern the webdataset documentation recommends for training: resampled shards (an
endless stream that works with any number of shards per worker), a shuffle buffer,
PIL decoding, the same transforms as the ``torchvision`` loader, batching inside the
workers, ``DataLoader(batch_size=None, num_workers=threads)``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import webdataset as wds
from torch.utils.data import DataLoader

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.imagefolder import train_transform
from shards.reader import ShardDataset

__all__ = ["open_loader"]

# Samples (still encoded) each worker holds to shuffle across shard boundaries.
_SHUFFLE_BUFFER = 1000


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches of ``spec.split`` read from the shard tars.

    Raises:
        FileNotFoundError: the split has no tars.
    """
    split = ShardDataset.open("bench", spec.shards).splits[spec.split]
    urls = [str(p) for p in split.shard_paths]
    if not urls:
        raise FileNotFoundError(f"no .tar shards under {spec.shards / spec.split}")
    dataset = (
        wds.WebDataset(urls, resampled=True, shardshuffle=False, seed=spec.seed)
        .shuffle(_SHUFFLE_BUFFER)
        .decode("pil")
        .to_tuple("jpg", "cls")
        .map_tuple(train_transform(spec.image_size_px), int)
        .batched(spec.batch_size, partial=False)
    )
    loader = DataLoader(dataset, batch_size=None, num_workers=spec.threads)
    yield (Batch(len(images), images, "NCHW", "uint8") for images, _ in loader)
