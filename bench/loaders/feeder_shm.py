"""``feeder-shm``: ``feeder serve`` in a process of its own, consumed by
``FeederLoader`` on the same host: the pixels come through the stream's
shared-memory ring in host memory (with ``--device gpu`` too: the daemon copies each
batch from the GPU, the rank copies it back; ``feeder-cuda-ipc`` keeps it there), gRPC
carries only the slot references (see ``feeder_grpc``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

from bench.loaders.base import Batch, LoaderSpec
from bench.loaders.feeder_grpc import daemon_stats, open_shared
from bench.loaders.feeder_grpc import open_loader as _open_loader

__all__ = ["daemon_stats", "open_loader", "open_shared"]


def open_loader(spec: LoaderSpec, shared: object = None) -> AbstractContextManager[Iterator[Batch]]:
    """As ``feeder-grpc``'s, over shared memory."""
    return _open_loader(spec, shared, transport="shm")
