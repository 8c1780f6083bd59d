"""``inprocess``: the daemon's own code, in the consumer's process, without the gRPC hop.

A :class:`feeder.service.FeederService` is built here as ``feeder serve`` builds it
(same index and tar reader, epoch plan, producer thread, crop windows drawn
from (seed, epoch, key), DALI ROI decode and CPU resize, thread budget as
``feeder serve --threads``) and one stream of many epochs is read straight from its
queue. This is the ceiling the daemon is measured against.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bench.loaders.base import Batch, LoaderSpec, dtype_name
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, StreamSpec, open_datasets

__all__ = ["daemon_batches", "open_loader"]

_EPOCHS = 1_000_000  # one stream, epochs back to back: endless for a benchmark


@contextmanager
def daemon_batches(
    shards: Path, split: str, request: StreamSpec, *, device: str = "cpu", threads: int = 2, prefetch: int = 2,
    decoded_cache_bytes: int = 0, decoded_cache_side: int = 256,
) -> Iterator[Iterator[np.ndarray]]:
    """Yields an endless iterator of the uint8 NHWC image batches the daemon would send
    for ``request`` (its ``dataset`` is ignored), produced in this process."""
    config = ServerConfig(
        datasets={"bench": Path(shards)}, device=device, threads=threads, prefetch=prefetch,
        max_batch_size=max(request.batch_size, 1), metrics_port=None,
        decoded_cache_bytes=decoded_cache_bytes, decoded_cache_side=decoded_cache_side,
    )
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    spec = StreamSpec(**{**request.__dict__, "dataset": "bench", "split": split, "epochs": _EPOCHS})
    stream = service.open_stream(spec)
    try:
        yield (batch.images for batch in stream)
    finally:
        stream.close()
        service.close()


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches decoded and augmented by the daemon's code here.

    Raises:
        core.errors.NotFound, core.errors.DataError: ``spec.shards`` is not a
            readable shard directory, or has no ``spec.split``.
    """
    request = StreamSpec(
        dataset="bench", split=spec.split, rank=spec.client_rank, world_size=spec.clients,
        batch_size=spec.batch_size, image_size=spec.image_size_px, seed=spec.seed,
    )
    with daemon_batches(spec.shards, spec.split, request, device=spec.device, threads=spec.threads,
                        decoded_cache_bytes=spec.decoded_cache_bytes,
                        decoded_cache_side=spec.decoded_cache_side) as images:
        yield (Batch(len(b), b, "NHWC", dtype_name(b)) for b in images)
