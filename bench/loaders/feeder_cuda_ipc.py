"""``feeder-cuda-ipc``: ``feeder serve --device gpu`` in a process of its own, each
consumer a ``FeederLoader`` rank on a GPU of the same host asking for CUDA IPC: the
daemon decodes on the rank's GPU into a ring of device slots it shares, gRPC carries
only the slot references, and no batch goes through host memory (the row's
``daemon.gpu_host_copies`` says whether one did). GPU only (see ``feeder_grpc``)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager

from bench.loaders import feeder_grpc
from bench.loaders.base import Batch, LoaderSpec, LoaderUnavailable
from bench.loaders.feeder_grpc import daemon_stats

__all__ = ["daemon_stats", "open_loader", "open_shared"]


def _needs_gpu(spec: LoaderSpec) -> None:
    if spec.device != "gpu":
        raise LoaderUnavailable("CUDA IPC needs --device gpu")


def open_shared(spec: LoaderSpec) -> AbstractContextManager[str]:
    """Starts the daemon (``feeder-grpc``'s).

    Raises:
        LoaderUnavailable: not ``--device gpu`` (a CPU consumer has no device ring).
    """
    _needs_gpu(spec)
    return feeder_grpc.open_shared(spec)


def open_loader(spec: LoaderSpec, shared: object = None) -> AbstractContextManager[Iterator[Batch]]:
    """As ``feeder-grpc``'s, over CUDA IPC.

    Raises:
        LoaderUnavailable: not ``--device gpu``.
    """
    _needs_gpu(spec)
    return feeder_grpc.open_loader(spec, shared, transport="cuda_ipc")
