"""The one place a :class:`feeder.service.FeederService` is put together: every part
it is made of, each owning one job, built from the configuration and the opened
datasets in the order they need each other."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from core.gpus import GpuInventory
from core.workers import FairPool
from decode.autotune import Tunable, Tuner
from decode.decoded_cache import DecodedCache
from decode.devices import DevicePlacer, resolve_device
from decode.pool import PipelinePool
from feeder.admission import Admission
from feeder.bad_samples import BadSamples
from feeder.config import LIBRARY_BYTES, ServerConfig, physical_memory_bytes
from feeder.config_values import usable_cpus
from feeder.idle_streams import IdleStreams
from feeder.metrics import ServerMetrics
from feeder.peers import PeerProcesses
from feeder.shares import FairShares
from feeder.stream import BatchStream
from feeder.stream_pipelines import StreamPipelines
from feeder.usage import Usage
from feeder.watcher import Watcher
from shards.ranged import READ_AHEAD_BYTES
from shards.reader import ShardDataset
from transport.daemon import TransportHub

__all__ = ["ServiceParts", "assemble", "grant_prefetch"]

log = logging.getLogger(__name__)

Split = tuple[str, str]  # (dataset, split)


@dataclass(frozen=True)
class ServiceParts:
    """What one daemon's service is made of.

    Attributes:
        device: ``cpu`` or ``gpu``, as ``--device`` resolved on this machine.
        devices: where a stream's pipeline runs (the GPU a client names).
        workers: the node's decode threads (``--threads``).
        shares: their time shared fairly among streams or jobs (``--fair-share``).
        peers: who a client is (its process, where the daemon can tell).
        admission: the open streams and the budgets they are admitted against.
        bad: the bad samples found so far, per (dataset, split).
        pool: built pipelines, lent to streams.
        pipelines: a new stream's pipeline chosen, lent, put behind the cache.
        decoded_cache: decoded images shared by every stream, or None.
        transports: the senders of batches (shared memory, CUDA IPC, gRPC).
        usage: what streams and jobs use, reported.
        tuner: the threads and prefetch left to it, tuned from what streams measure.
        idle: the unread streams' cancel.
        watcher: the thread that runs idle, usage, tuner and the rings' collection.
    """

    device: str
    devices: DevicePlacer
    workers: FairPool
    shares: FairShares
    peers: PeerProcesses
    admission: Admission[BatchStream]
    bad: Mapping[Split, BadSamples]
    pool: PipelinePool
    pipelines: StreamPipelines
    decoded_cache: DecodedCache | None
    transports: TransportHub
    usage: Usage
    tuner: Tuner
    idle: IdleStreams
    watcher: Watcher


def grant_prefetch(admission: Admission[BatchStream], stream: Tunable, runs: int) -> bool:
    """Set ``stream``'s runs in flight to ``runs`` where the memory budget has room
    for them (the tuner's ask)."""
    if not isinstance(stream, BatchStream) or not admission.set_runs(stream, runs - stream.prefetch):
        return False
    stream.prefetch = runs
    return True


def assemble(config: ServerConfig, datasets: Mapping[str, ShardDataset], metrics: ServerMetrics) -> ServiceParts:
    """Every part of a daemon's service, its watcher started."""
    # The GPUs are asked for once, and not at all by a CPU daemon.
    gpus = GpuInventory() if config.device == "cpu" else GpuInventory.of_this_process()
    device = resolve_device(config.device, gpus)
    _say_footprint(config, datasets)
    devices = DevicePlacer.of_this_process(device, gpus)
    admission: Admission[BatchStream] = Admission(config, metrics)
    budgets, tuning = config.budgets, config.tuning
    workers = FairPool(tuning.decode_threads)
    pool = PipelinePool(budgets.max_pipelines, budgets.pipeline_idle_s, metrics.pipelines_held, workers=workers)
    decoded_cache = None
    if config.decoded_cache.decoded_cache_bytes:  # one cache for every stream and job of this daemon
        decoded_cache = DecodedCache(config.decoded_cache.decoded_cache_bytes, config.decoded_cache.decoded_cache_side)
        metrics.decoded_cache(usage=decoded_cache.usage())
    transports = TransportHub(config.shm.transport)
    usage = Usage(metrics)
    # What is not given is tuned while streams run (--threads, --prefetch left at 0).
    tuner = Tuner(lambda: [stream for stream, _ in admission.open()], metrics, usable_cpus(), workers,
                  tune_threads=tuning.autotune and not tuning.threads,
                  grant=partial(grant_prefetch, admission) if tuning.autotune and not tuning.prefetch else None)
    idle = IdleStreams(config, admission, metrics)
    return ServiceParts(
        device=device, devices=devices, workers=workers, shares=FairShares(workers, config.tuning.fair_share),
        peers=PeerProcesses(), admission=admission, bad=_bad_samples(config, datasets, metrics), pool=pool,
        pipelines=StreamPipelines(config, devices, pool, decoded_cache, metrics, lambda: len(admission),
                                  admission.ran_out),
        decoded_cache=decoded_cache, transports=transports, usage=usage, tuner=tuner, idle=idle,
        # transports.collect: device rings of ended streams, once their clients let go
        watcher=Watcher(idle.tick_s, (idle.tick, usage.tick, tuner.tick, transports.collect)).start(),
    )


def _bad_samples(config: ServerConfig, datasets: Mapping[str, ShardDataset],
                 metrics: ServerMetrics) -> dict[Split, BadSamples]:
    return {(name, split): BadSamples(name, index, config.decoding.max_pixels, metrics.bad_sample_found)
            for name, dataset in datasets.items() for split, index in dataset.splits.items()}


def _say_footprint(config: ServerConfig, datasets: Mapping[str, ShardDataset]) -> None:
    """One line on the most memory this daemon should take; a warning where that is
    more than the machine has."""
    gib = 1 << 30
    remote_splits = sum(len(d.splits) for d in datasets.values() if not isinstance(d.root, Path))
    read_ahead = READ_AHEAD_BYTES * remote_splits
    footprint, physical = config.footprint_bytes + read_ahead, physical_memory_bytes()
    level = logging.WARNING if footprint > physical else logging.INFO
    log.log(level, "memory: at most %.1f GiB (streams %.1f, shared memory %.1f, decoded cache %.1f, remote read-ahead "
            "%.1f, libraries %.1f) of the machine's %.1f GiB", footprint / gib, config.budgets.max_memory_bytes / gib,
            config.shm.shm_budget_bytes / gib, config.decoded_cache.decoded_cache_bytes / gib, read_ahead / gib,
            LIBRARY_BYTES / gib, physical / gib)
