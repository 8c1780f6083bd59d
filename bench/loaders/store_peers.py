"""What the object-store peers (``streaming``, ``webdataset-s3``, ``litdata``) share.

They run in virtual environments of their own (``bench/venvs.py``), so this module
imports the standard library only at its top; torch, torchvision and PIL are imported
where they are used, in the loader's interpreter. Each peer does the work of the
``torchvision`` loader (RandomResizedCrop, horizontal flip, uint8 CHW tensors) on the
JPEG bytes it reads from the store, in ``threads`` DataLoader workers, and keeps what
it downloads in a cache folder of its own that is new at every start (so a start's
first epoch is cold and its later ones warm, as for ``feeder-s3``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.tar_samples import manifest_digest

__all__ = [
    "FEEDER_PREFIX", "TORCH_REQUIREMENTS", "augmented", "batches", "built_once", "decode", "local_dataset",
    "store_root", "train_transform",
]

# Where the bench puts feeder's shards in the bucket (WebDataset reads the same tars).
FEEDER_PREFIX = "feeder"
# What every peer's environment holds beside the peer itself (the project's versions).
TORCH_REQUIREMENTS = ("torch==2.14.1", "torchvision==0.29.1", "pillow==13.0.0", "boto3==1.44.8")


def store_root(spec: LoaderSpec, prefix: str) -> str:
    """``s3://bucket/prefix`` of a peer's copy in the store the bench filled.

    Raises:
        ValueError: the spec names no store (``throughput.py --store s3`` not given).
    """
    if not spec.store_url:
        raise ValueError("this loader reads from an object store: run throughput.py with --store s3")
    return f"{spec.store_url}/{prefix}"


def local_dataset(spec: LoaderSpec, name: str) -> Path:
    """Where a peer's ``prepare`` keeps its own format of ``spec.shards`` (made again
    when the shards change)."""
    cache = spec.cache or Path("/tmp")
    return cache / f"{name}-{spec.split}-{manifest_digest(spec.shards)[:16]}"


def built_once(target: Path, build: Callable[[Path], object]) -> None:
    """``build(tmp)`` into a sibling folder renamed to ``target`` when done (nothing if
    ``target`` exists), so an interrupted run never leaves a folder that looks made."""
    if target.exists():
        return
    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    tmp.rename(target)


def train_transform(image_size_px: int) -> Any:
    """The ``torchvision`` loader's augmentation, ending in a uint8 CHW tensor."""
    from torchvision import transforms

    return transforms.Compose(
        [transforms.RandomResizedCrop(image_size_px), transforms.RandomHorizontalFlip(), transforms.PILToTensor()]
    )


def decode(jpeg: bytes) -> Any:
    """The RGB PIL image of ``jpeg``."""
    import io

    from PIL import Image

    return Image.open(io.BytesIO(jpeg)).convert("RGB")


def augmented(dataset: type, image_size_px: int) -> type:
    """A subclass of a peer's ``dataset`` class (its ``StreamingDataset``, of the
    peer's venv) whose samples, ``{"jpg": bytes, "cls": label}`` as the bench wrote
    them, come out decoded and augmented: ``(uint8 CHW tensor, label)``."""
    transform = train_transform(image_size_px)

    class Augmented(dataset):  # type: ignore[misc, valid-type]
        def __getitem__(self, index: Any) -> Any:
            sample = super().__getitem__(index)
            return transform(decode(sample["jpg"])), sample["cls"]

    return Augmented


def batches(epoch: Callable[[], Iterable[Any]]) -> Iterator[Batch]:
    """Endless ``Batch`` es from ``epoch()``, an iterable of ``(images, labels)`` over
    one epoch, called again for each."""
    while True:
        for images, _ in epoch():
            yield Batch(len(images), images, "NCHW", "uint8")
