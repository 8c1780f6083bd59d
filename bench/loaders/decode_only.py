"""``decode-only``: libjpeg-turbo decoding of the shards' JPEGs and nothing else.

The physical ceiling of a CPU JPEG pipeline: ``threads`` processes, each decoding the
same encoded bytes the other loaders read (held in memory, so no I/O is timed) to full
size RGB with Pillow (libjpeg-turbo, the decoder of the torchvision and webdataset
loaders), with no crop, resize, flip, batching or transfer of pixels. Each ``Batch``
reports the shapes of the images one process decoded. The processes import only
Pillow, so they start in well under a second.
"""

from __future__ import annotations

import io
import multiprocessing as mp
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from PIL import Image

from bench.loaders.base import Batch, LoaderSpec
from shards.reader import ShardDataset

__all__ = ["open_loader"]

# Encoded samples each process keeps in memory (about 40 MB of ImageNet-sized JPEGs).
_MAX_SAMPLES = 400
# Decode tasks queued per process so no process waits for the next one.
_TASKS_PER_PROCESS = 2

_jpegs: list[bytes] = []


def _keep(jpegs: list[bytes]) -> None:
    _jpegs.extend(jpegs)


def _decode(start: int, count: int) -> list[tuple[int, int, int]]:
    """Decodes ``count`` JPEGs from ``start`` (wrapping); returns their HWC shapes."""
    shapes = []
    for i in range(start, start + count):
        image = Image.open(io.BytesIO(_jpegs[i % len(_jpegs)])).convert("RGB")  # decodes
        shapes.append((image.height, image.width, len(image.getbands())))
    return shapes


def _batches(pool, spec: LoaderSpec) -> Iterator[Batch]:
    pending: deque = deque()
    start = 0
    while True:
        while len(pending) < spec.threads * _TASKS_PER_PROCESS:
            pending.append(pool.apply_async(_decode, (start, spec.batch_size)))
            start += spec.batch_size
        shapes = pending.popleft().get()
        yield Batch(len(shapes), shapes, "decoded", "uint8")


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless ``decoded`` batches of ``spec.batch_size`` images each.

    Raises:
        FeederError: ``spec.shards`` is not a shard directory with ``spec.split``.
    """
    # Read here, not in the pool's initializer: a pool replaces workers whose
    # initializer fails, forever, instead of reporting the error.
    split = ShardDataset.open("bench", spec.shards).splits[spec.split]
    jpegs = [split.read(i).tobytes() for i in range(min(len(split), _MAX_SAMPLES))]
    context = mp.get_context("spawn")
    with context.Pool(spec.threads, initializer=_keep, initargs=(jpegs,)) as pool:
        yield _batches(pool, spec)
