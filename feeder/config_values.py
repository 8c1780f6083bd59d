"""The values :class:`feeder.config.ServerConfig` takes, parsed and checked: the
``--dataset`` entries (paths and object store URLs), loopback hosts, the machine's
memory and CPUs (its container's, where a cgroup limits them) and what the daemon's
libraries take of it."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Callable
from pathlib import Path

from core.cpus import CGROUP, usable_cpus
from core.errors import ConfigError
from decode.look_ahead import DEFAULT_LOOKAHEAD

__all__ = [
    "BOUNDS",
    "DEFAULT_GPU_PREFETCH",
    "DEFAULT_LOOKAHEAD",
    "DEFAULT_PREFETCH",
    "DEFAULT_RING_SLOTS",
    "LIBRARY_BYTES",
    "cgroup_memory_bytes",
    "is_loopback",
    "parse_datasets",
    "physical_memory_bytes",
    "usable_cpus",
]

# Pipeline runs in flight per stream where ``--prefetch`` is not given (where the tuner starts).
DEFAULT_PREFETCH = 2
# The same on a GPU: its runs are short, and the producer, the DALI run and the copy
# into the slot then each have one in hand.
DEFAULT_GPU_PREFETCH = 3
# Ring slots of a stream whose client says nothing of its prefetch (FeederLoader's
# default of 4, the daemon's queue of 4, the batch read, one on the wire).
DEFAULT_RING_SLOTS = 10

# The numeric options' bounds: (options, test, what the error says they must be).
BOUNDS: tuple[tuple[tuple[str, ...], Callable[[float], bool], str], ...] = (
    (("queue_batches", "queue_bytes", "max_batch_size", "max_epoch_samples", "max_streams", "max_streams_per_peer",
      "max_streams_per_address", "max_streams_per_job", "max_memory_bytes", "store_requests",
      "max_pixels", "max_pipelines", "max_waiting_calls", "metrics_threads"), lambda v: v >= 1, ">= 1"),
    (("threads", "prefetch", "ring_slots", "store_retry_window_s", "store_heal_s", "grace_s", "rpc_threads",
      "lookahead"),
     lambda v: v >= 0, ">= 0"),
    (("idle_timeout_s", "contended_idle_timeout_s", "pipeline_idle_s", "first_message_timeout_s",
      "metrics_timeout_s"), lambda v: v > 0, "> 0"),
    (("max_failed_batch_fraction", "max_failed_epoch_fraction"), lambda v: 0 <= v <= 1, "in 0..1"),
)


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback IP addresses (127.0.0.0/8, ::1); a host
    name is not resolved, so any other name counts as reachable from outside."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def parse_datasets(values: list[str], option: str = "--dataset") -> dict[str, Path | str]:
    """``["imagenet=/data/shards", "web=s3://bucket/shards"]`` -> ``{"imagenet":
    Path("/data/shards"), "web": "s3://bucket/shards"}``: local roots as paths
    (``file:///x`` is ``/x``), object store roots as their URLs.

    Raises:
        ConfigError: an entry without ``=``, a name given twice, or a store URL that
            cannot be (naming ``option``).
    """
    from shards.objects import ObjectUrl, is_remote, local_path  # no client library loads here

    datasets: dict[str, Path | str] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"{option} {value!r}: expected NAME=PATH, e.g. imagenet=/data/shards")
        if name in datasets:
            raise ConfigError(f"{option} {name!r}: given twice")
        if is_remote(path):
            try:
                datasets[name] = str(ObjectUrl.parse(path))
            except ConfigError as e:
                raise ConfigError(f"{option} {value!r}: {e}") from e
        else:
            datasets[name] = local_path(path)
    return datasets


def physical_memory_bytes(cgroup: Path = CGROUP) -> int:
    """This machine's physical memory, or its container's limit where lower (a pod's
    ``resources.limits.memory``, a Slurm job's ``--mem``): a daemon sized on the node's
    memory inside a smaller limit is killed by the kernel, not refused."""
    physical = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    limit = cgroup_memory_bytes(cgroup)
    return min(physical, limit) if limit else physical


def cgroup_memory_bytes(cgroup: Path = CGROUP) -> int | None:
    """The memory limit of this process's cgroup (v2 ``memory.max``, v1
    ``memory.limit_in_bytes``); None: none is set."""
    for path in (cgroup / "memory.max", cgroup / "memory" / "memory.limit_in_bytes"):
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit():
            return int(text)
    return None


# Resident memory of a daemon with its libraries loaded (DALI, torch with CUDA,
# OpenCV, gRPC) and no stream open: 0.83 GiB measured on the development machines
# (VmRSS of an idle `feeder serve`), rounded up.
LIBRARY_BYTES = 1 << 30

