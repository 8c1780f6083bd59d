"""``feeder-grpc``: ``feeder serve`` in a process of its own, the pixels inside the
gRPC messages (what a client on another host gets). ``feeder-shm`` is the same with
the pixels in host shared memory (what a client on the daemon's host gets), and
``feeder-cuda-ipc`` with them in a ring of device slots (a rank on the daemon's GPU).

The daemon is started once (``open_shared``) with the thread budget as its DALI
threads; each consumer is a ``clients.FeederLoader`` for its rank, as a training
process uses it, epoch after epoch, kept as uint8 on the CPU (``normalize=False``: the
other loaders stop at uint8 too). With ``--device gpu`` each consumer is a rank on a
GPU (rank r on GPU r mod count): the daemon decodes on that GPU and hands the batch
over in host memory (``feeder-shm``, ``feeder-grpc``) or through CUDA IPC
(``feeder-cuda-ipc``). The daemon is a child of the loader's process, so its CPU time
and memory are charged to this loader; its counters (``daemon_stats``) go in the row.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from bench.loaders.base import Batch, LoaderSpec, dtype_name
from clients import FeederLoader
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc

__all__ = ["DATASET", "daemon_options", "daemon_stats", "open_loader", "open_shared"]

DATASET = "bench"


def daemon_options(spec: LoaderSpec) -> tuple[str, ...]:
    """The ``feeder serve`` options every bench daemon gets from ``spec``."""
    cache = (
        "--decoded-cache-bytes", str(spec.decoded_cache_bytes), "--decoded-cache-side", str(spec.decoded_cache_side),
    )
    return ("--device", spec.device, "--threads", str(spec.threads), "--max-batch-size", str(spec.batch_size), *cache)


@contextmanager
def open_shared(spec: LoaderSpec) -> Iterator[str]:
    """Starts ``feeder serve`` on a free port; yields its ``host:port``; stops it after."""
    with DaemonProcess({DATASET: spec.shards}, daemon_options(spec), die_with_parent=True) as daemon:
        yield daemon.address


# The daemon's counters that say how its batches were made.
_STATS = ("images_served", "batches_served", "gpu_batches", "gpu_host_copies")


def daemon_stats(shared: object) -> dict[str, int]:
    """The counters of the daemon at ``shared`` (its address) that say how its batches
    were made: ``gpu_host_copies`` counts GPU batches copied through host memory."""
    with grpc.insecure_channel(str(shared)) as channel:
        stats = feeder_pb2_grpc.FeederStub(channel).GetStats(feeder_pb2.StatsRequest(), timeout=10)
    return {name: int(getattr(stats, name)) for name in _STATS}


def _batches(loader: FeederLoader, transport: str) -> Iterator[Batch]:
    """Endless batches of ``loader``, each checked to have come over ``transport``.

    Raises:
        RuntimeError: a batch came over another transport (never measure one as another).
    """
    while True:  # each pass over the loader is the rest of one epoch
        for images, _ in loader:
            if loader.transport != transport:
                raise RuntimeError(f"asked for {transport}, the batches came over {loader.transport}")
            yield Batch(len(images), images, "NCHW", dtype_name(images))


def _device(spec: LoaderSpec) -> str:
    if spec.device != "gpu":
        return "cpu"
    import torch

    return f"cuda:{spec.client_rank % torch.cuda.device_count()}"


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None, transport: str = "grpc") -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches streamed by the daemon at ``shared``.

    Raises:
        ValueError: ``shared`` is not a daemon address (``open_shared`` was not run).
    """
    if not isinstance(shared, str):
        raise ValueError("feeder-grpc needs the address of a running daemon (open_shared)")
    if spec.separate_jobs:  # one job per consumer: own seed and id, the whole split each
        seed, rank, world, job = spec.seed + spec.client_rank, 0, 1, f"bench-{spec.client_rank}"
    else:
        seed, rank, world, job = spec.seed, spec.client_rank, spec.clients, "bench"
    loader = FeederLoader(
        DATASET, address=shared, split=spec.split, batch_size=spec.batch_size, image_size=spec.image_size_px,
        seed=seed, rank=rank, world_size=world, device=_device(spec), normalize=False, augment="train",
        job_id=job, transport=transport,
    )
    with loader:
        yield _batches(loader, transport)
