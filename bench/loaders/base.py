"""What every benchmarked loader is given, and what it hands back.

A loader is a module with ``open_loader(spec, shared)``: a context manager that does all its
setup (worker processes, daemons, file indexes) before it yields, and yields an endless
iterator of ``Batch``. ``shared`` is what the module's optional ``open_shared(spec)``
yielded (for example a daemon's address), or None. Everything inside the ``with`` block before the first batch is
setup and is never timed.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

__all__ = [
    "DEVICES", "LAYOUTS", "Batch", "LoaderModule", "LoaderSpec", "LoaderUnavailable", "check_batch", "dtype_name",
]

DEVICES = ("cpu", "gpu")
# "decoded": full-size decoded images whose pixels stay where they were decoded;
# ``Batch.images`` then holds their (height, width, channels) shapes.
LAYOUTS = ("NCHW", "NHWC", "decoded")


class LoaderUnavailable(Exception):
    """The loader cannot run here (an optional package is missing): it is reported as
    skipped, with this one-line reason, not as a failure."""


@dataclass(frozen=True)
class LoaderSpec:
    """The work every loader does and the budget it gets.

    Args:
        shards: shard directory made by ``feeder shard``.
        source: the JPEG tree the shards were made from (for ``ImageFolder``).
        split: split to read; train augmentation (RandomResizedCrop + flip) throughout.
        batch_size: images per batch.
        image_size_px: output side of the square crops.
        threads: CPU budget: worker processes or threads each loader may use.
        device: ``cpu``, or ``gpu`` for the DALI and feeder pipelines on CUDA.
        seed: seed of shuffles and augmentation.
        clients: concurrent consumers of one daemon (feeder loaders only).
        client_rank: which consumer this is (0-based, < clients).
        separate_jobs: the consumers are separate jobs (each its own job id and seed,
            every sample once per epoch each) instead of the ranks of one job.
        decoded_cache_bytes: ``feeder serve --decoded-cache-bytes`` (0: no cache).
        decoded_cache_side: ``feeder serve --decoded-cache-side``, px.
        cache: folder where a loader keeps what it derives from the data once (FFCV's
            dataset file), ``throughput.py --cache``; None: the system's temporary folder.
        store_url: with ``throughput.py --store s3``, the bucket the bench filled
            (``s3://bench``): feeder's shards under ``feeder/``, each peer's own format
            under its ``STORE_PREFIX``; empty: the loaders read local files.
        store_endpoint: the S3 API of that store (``http://127.0.0.1:PORT``); the
            credentials are in the standard AWS variables of the worker's environment.
    """

    shards: Path
    source: Path | None
    split: str = "train"
    batch_size: int = 64
    image_size_px: int = 224
    threads: int = 2
    device: str = "cpu"
    seed: int = 0
    clients: int = 1
    client_rank: int = 0
    separate_jobs: bool = False
    decoded_cache_bytes: int = 0
    decoded_cache_side: int = 256
    cache: Path | None = None
    store_url: str = ""
    store_endpoint: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "shards", Path(self.shards))
        for name in ("source", "cache"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, Path(getattr(self, name)))
        if self.batch_size < 1 or self.image_size_px < 8 or self.threads < 1:
            raise ValueError("batch_size >= 1, image_size_px >= 8 and threads >= 1 are required")
        if self.device not in DEVICES:
            raise ValueError(f"device must be one of {DEVICES}, got {self.device!r}")
        if not 0 <= self.client_rank < self.clients:
            raise ValueError(f"client_rank must be in [0, {self.clients}), got {self.client_rank}")


@dataclass(frozen=True)
class Batch:
    """One batch as the consumer receives it.

    Args:
        count: images in the batch.
        images: uint8 pixels (torch tensor or numpy array) in ``layout``; for the
            ``decoded`` layout a list of ``(height, width, channels)`` shapes.
        layout: one of ``LAYOUTS``.
        dtype: element type of the pixels, as a string (``"uint8"``).
    """

    count: int
    images: Any
    layout: str
    dtype: str


class LoaderModule(Protocol):
    """The interface of each module under ``bench/loaders``."""

    def open_loader(self, spec: LoaderSpec, shared: object = None) -> AbstractContextManager[Iterator[Batch]]: ...


def dtype_name(images: Any) -> str:
    """``"uint8"`` for a uint8 torch tensor or numpy array."""
    return str(images.dtype).removeprefix("torch.")


def check_batch(batch: Batch, spec: LoaderSpec) -> list[str]:
    """Problems with ``batch`` as output for ``spec`` (empty when it is correct)."""
    if batch.dtype != "uint8":
        return [f"dtype is {batch.dtype}, expected uint8"]
    if batch.layout == "decoded":
        bad = [s for s in batch.images if len(s) != 3 or s[2] != 3 or min(s[:2]) < 1]
        return [f"decoded shapes {bad} are not (height, width, 3)"] if bad or not batch.images else []
    side = spec.image_size_px
    expected = {"NCHW": (batch.count, 3, side, side), "NHWC": (batch.count, side, side, 3)}.get(batch.layout)
    if expected is None:
        return [f"unknown layout {batch.layout!r}"]
    shape = tuple(batch.images.shape)
    problems = [] if shape == expected else [f"shape {shape}, expected {expected} ({batch.layout})"]
    if batch.count != spec.batch_size:
        problems.append(f"{batch.count} images, expected batches of {spec.batch_size}")
    return problems
