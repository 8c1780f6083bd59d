"""``decode-only``: libjpeg-turbo decoding of the shards' JPEGs and nothing else.

The physical ceiling of a CPU JPEG pipeline: ``threads`` processes, each decoding the
same encoded bytes the other loaders read (held in memory, so no I/O is timed), with no
crop, resize, flip, batching or transfer of pixels. Each ``Batch`` reports the shapes
of the full-size images one process decoded.
"""

from __future__ import annotations

import multiprocessing as mp
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.shard_files import read_index, read_jpegs

__all__ = ["open_loader"]

# Encoded samples each process keeps in memory (about 40 MB of ImageNet-sized JPEGs).
_MAX_SAMPLES = 400
# Decode tasks queued per process so no process waits for the next one.
_TASKS_PER_PROCESS = 2

_jpegs: list[bytes] = []


def _load(shards: Path, split: str) -> None:
    import torch

    torch.set_num_threads(1)
    _jpegs.extend(read_jpegs(shards, read_index(shards, split), limit=_MAX_SAMPLES))


def _decode(start: int, count: int) -> list[tuple[int, ...]]:
    """Decodes ``count`` JPEGs from ``start`` (wrapping); returns their HWC shapes."""
    import torch
    from torchvision.io import ImageReadMode, decode_jpeg

    shapes = []
    for i in range(start, start + count):
        data = torch.frombuffer(bytearray(_jpegs[i % len(_jpegs)]), dtype=torch.uint8)
        chw = decode_jpeg(data, mode=ImageReadMode.RGB)
        shapes.append((chw.shape[1], chw.shape[2], chw.shape[0]))
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
    """Yields endless ``decoded`` batches of ``spec.batch_size`` images each."""
    context = mp.get_context("spawn")
    with context.Pool(spec.threads, initializer=_load, initargs=(spec.shards, spec.split)) as pool:
        yield _batches(pool, spec)
