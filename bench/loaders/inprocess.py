"""``inprocess``: the daemon's own code, in the consumer's process, without the gRPC hop.

A :class:`feeder.service.FeederService` is built here as ``feeder serve`` builds it
(same index and tar reader, epoch plan, producer thread, crop windows drawn
from (seed, epoch, key), window decode and CPU resize, thread budget as
``feeder serve --threads``) and one stream of many epochs is read straight from its
queue. This is the ceiling the daemon is measured against. On the GPU the batches stay
on the device, in a device ring on GPU 0, as a rank on that GPU gets them.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch

from bench.loaders.base import Batch, LoaderSpec, dtype_name
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from feeder.stream import BatchStream
from protocol.request import StreamSpec
from transport.base import HostIdentity, TransportKind
from transport.daemon import TransportRequest

__all__ = ["daemon_batches", "open_loader"]

_EPOCHS = 1_000_000  # one stream, epochs back to back: endless for a benchmark


@contextmanager
def daemon_batches(
    shards: Path, split: str, request: StreamSpec, *, device: str = "cpu", threads: int = 2, prefetch: int = 2,
    decoded_cache_bytes: int = 0, decoded_cache_side: int = 256,
) -> Iterator[Iterator[np.ndarray | torch.Tensor]]:
    """Yields an endless iterator of the uint8 NHWC image batches the daemon would send
    for ``request`` (its ``dataset`` is ignored), produced in this process: numpy
    arrays, or CUDA tensors on GPU 0 for ``device="gpu"``."""
    config = ServerConfig.of(
        datasets={"bench": Path(shards)}, device=device, threads=threads, prefetch=prefetch,
        max_batch_size=max(request.batch_size, 1), metrics_port=None,
        decoded_cache_bytes=decoded_cache_bytes, decoded_cache_side=decoded_cache_side,
    )
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    spec = StreamSpec(**{**request.__dict__, "dataset": "bench", "split": split, "epochs": _EPOCHS})
    stream = service.open_stream(spec, transport=_transport(service.device))
    try:
        yield _images(stream)
    finally:
        stream.close()
        service.close()


def _transport(device: str) -> TransportRequest:
    """Host memory for a CPU stream; for a GPU one, a device ring on GPU 0 (the
    daemon's CUDA IPC sender: no host copy, nothing shared across processes)."""
    if device != "gpu":
        return TransportRequest(preference=TransportKind.GRPC)
    from core.gpus import device_uuid

    return TransportRequest(TransportKind.CUDA_IPC, HostIdentity.of_this_process().client_host(device_uuid(0)))


def _images(stream: BatchStream) -> Iterator[np.ndarray | torch.Tensor]:
    """Each batch's images; a device slot goes back to its ring once the batch's
    writes have finished and the consumer has asked for the next one."""
    for batch in stream:
        yield batch.slot.pixels
        if batch.slot.on_gpu:
            torch.cuda.current_stream(batch.slot.tensor.device).synchronize()
            stream.sender.release(batch.slot.index, batch.slot.generation)


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
