"""The CPUs this process may use, and worker counts held to them."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

__all__ = ["CGROUP", "capped_workers", "usable_cpus"]

log = logging.getLogger(__name__)

CGROUP = Path("/sys/fs/cgroup")


def usable_cpus(cgroup: Path = CGROUP) -> int:
    """The CPUs this process may use: those it is pinned to (``taskset``, Slurm's
    ``--cpus-per-task``), at most its cgroup's CPU quota rounded up (a pod's
    ``resources.limits.cpu``, v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``)."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    for quota_file, period_file in ((cgroup / "cpu.max", None),
                                    (cgroup / "cpu" / "cpu.cfs_quota_us", cgroup / "cpu" / "cpu.cfs_period_us")):
        try:
            fields = quota_file.read_text().split()
            if period_file is not None:
                fields.append(period_file.read_text().strip())
        except OSError:
            continue
        if len(fields) == 2 and fields[0].isdigit() and fields[1].isdigit() and int(fields[1]) > 0:
            cpus = min(cpus, max(1, math.ceil(int(fields[0]) / int(fields[1]))))
        break
    return max(1, cpus)


def capped_workers(workers: int, option: str, cpus: int | None = None) -> int:
    """``workers`` processes, at most one per CPU this process may use (``cpus``;
    asked when None): more only wait for a CPU, each with memory of its own. A count
    cut is one warning line naming ``option``."""
    cpus = usable_cpus() if cpus is None else cpus
    if workers <= cpus:
        return workers
    log.warning("%s %d: more than the %d CPUs this process may use; using %d", option, workers, cpus, cpus)
    return cpus
