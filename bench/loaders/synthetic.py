"""``synthetic``: the same uint8 batch over and over — the harness's own upper bound."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import repeat

import torch

from bench.loaders.base import Batch, LoaderSpec

__all__ = ["open_loader"]


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields one random uint8 NCHW batch of the requested size, forever."""
    side = spec.image_size_px
    generator = torch.Generator().manual_seed(spec.seed)
    images = torch.randint(0, 256, (spec.batch_size, 3, side, side), dtype=torch.uint8, generator=generator)
    yield repeat(Batch(spec.batch_size, images, "NCHW", "uint8"))
