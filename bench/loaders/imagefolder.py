"""``torchvision``: ImageFolder over the source JPEGs + a DataLoader — what most users run.

RandomResizedCrop + RandomHorizontalFlip + PILToTensor (uint8, CHW), ``num_workers``
equal to the thread budget, an endless shuffled sampler so epochs never drain the
prefetch queue.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader, RandomSampler
from torchvision import datasets, transforms

from bench.loaders.base import Batch, LoaderSpec

__all__ = ["open_loader", "train_transform"]

# Samples an endless sampler announces; it draws a fresh permutation every epoch.
_ENDLESS = 1 << 40
# Batches each DataLoader worker keeps ready (the DataLoader default).
_PREFETCH_PER_WORKER = 2


def train_transform(image_size_px: int) -> transforms.Compose:
    """The torchvision train augmentation, ending in a uint8 CHW tensor."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(image_size_px),
            transforms.RandomHorizontalFlip(),
            transforms.PILToTensor(),
        ]
    )


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches of ``spec.split`` read from ``spec.source``.

    Raises:
        ValueError: ``spec.source`` is not set.
    """
    if spec.source is None:
        raise ValueError("the torchvision loader needs the source JPEG tree (--source)")
    dataset = datasets.ImageFolder(str(spec.source / spec.split), transform=train_transform(spec.image_size_px))
    sampler = RandomSampler(dataset, num_samples=_ENDLESS, generator=torch.Generator().manual_seed(spec.seed))
    loader = DataLoader(
        dataset,
        batch_size=spec.batch_size,
        sampler=sampler,
        num_workers=spec.threads,
        prefetch_factor=_PREFETCH_PER_WORKER,
        drop_last=True,
    )
    yield (Batch(len(images), images, "NCHW", "uint8") for images, _ in loader)
