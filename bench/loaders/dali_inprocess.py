"""``dali``: the daemon's own read path and DALI pipeline, in the consumer's process.

Same index and tar reader (``shards.reader``), same epoch plan
(``feeder.plan``), same pipeline and runner (``feeder.pipeline``) with the same thread
budget as ``feeder serve --threads``; only the gRPC hop is missing. This is the ceiling
the daemon is measured against.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count

import numpy as np

from bench.loaders.base import Batch, LoaderSpec, dtype_name
from feeder.pipeline import AugmentKind, PipelineRunner, PipelineSpec
from feeder.plan import LastBatch, epoch_order, iter_batches, rank_part
from shards.reader import ShardDataset, SplitIndex

__all__ = ["open_loader"]


def _jpeg_batches(split: SplitIndex, spec: LoaderSpec) -> Iterator[tuple[list[np.ndarray], int]]:
    """Encoded batches of this rank's part, epoch after epoch, as the daemon plans them."""
    for epoch in count():
        order = epoch_order(len(split), spec.seed, epoch, shuffle=True)
        part = rank_part(order, spec.client_rank, spec.clients, LastBatch.DROP)
        for piece in iter_batches(part, 0, spec.batch_size, LastBatch.DROP):
            yield split.read_many(piece.indices), spec.image_size_px


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches decoded and augmented by DALI in this process.

    Raises:
        core.errors.NotFound, core.errors.DataError: ``spec.shards`` is not a
            readable shard directory, or has no ``spec.split``.
    """
    split = ShardDataset.open("bench", spec.shards).splits[spec.split]
    runner = PipelineRunner(
        PipelineSpec(kind=AugmentKind.TRAIN, device=spec.device, max_batch_size=spec.batch_size, threads=spec.threads),
        seed=spec.seed,
    )
    outputs = runner.run_many(_jpeg_batches(split, spec))
    yield (Batch(len(images), images, "NHWC", dtype_name(images)) for images in outputs)
