"""Sharder speed on a Ray cluster of N nodes on this machine, each node held to a CPU
quota (a cgroup, as ``bench/pool.py`` holds daemons), for each N of ``--ray-nodes``.

Each cluster is a head that runs no tasks (``num_cpus=0``: its control processes
stay out of the quotas) and N nodes of one CPU each, started with this process
inside the node's cgroup so that the node's raylet and every worker it starts are
held there. The driver (this process, ``sharder.shard`` with ``ray``) runs outside
the quotas: its CPU time per image is reported, the figure that says whether it
would be the limit. One untimed run per cluster warms the workers (they import the
image modules once per job); then ``--repeats`` timed runs of the whole call.

Scaling efficiency is images/s at N nodes over N times images/s at one node.
Needs root, a writable cgroup and Ray (``pip install 'feeder[ray]'``).

Example::

    python bench/shard.py --modes decode --workers 1 --ray-nodes 1,2,4 --node-cpus 0.25
"""

from __future__ import annotations

import os
import resource
import shutil
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.cpu_quota import CpuQuota
from sharder import ShardConfig, shard

__all__ = ["measure_nodes"]


def _own_cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _cpu_cgroup() -> Path:
    """This process's cgroup of the cpu controller (v1), or the unified one (v2)."""
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if "cpu" in controllers.split(","):
            return Path("/sys/fs/cgroup/cpu") / path.lstrip("/")
    return Path("/sys/fs/cgroup") / Path("/proc/self/cgroup").read_text().split("::", 1)[1].strip().lstrip("/")


@contextmanager
def _cluster(nodes: int, node_cpus: float) -> Iterator[tuple[Any, list[CpuQuota]]]:
    """A head and ``nodes`` nodes of one CPU, each node in a quota of ``node_cpus``."""
    from ray.cluster_utils import Cluster

    home = _cpu_cgroup()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    quotas = []
    try:
        for number in range(nodes):
            quota = CpuQuota(f"feeder-bench-ray-{os.getpid()}-{number}", node_cpus)
            quotas.append(quota)
            quota.add(os.getpid())  # the node's processes start here and stay
            try:
                cluster.add_node(num_cpus=1)
            finally:
                (home / "cgroup.procs").write_text(str(os.getpid()))
        cluster.wait_for_nodes()
        yield cluster, quotas
    finally:
        for quota in quotas:
            quota.lift()  # the nodes stop at the machine's pace, not the quota's
        cluster.shutdown()
        for quota in quotas:
            quota.remove()


def measure_nodes(src: Path, images: int, mode: str, options: dict, nodes: list[int], node_cpus: float, repeats: int,
                  scratch: Path) -> list[dict]:
    """One row per N of ``nodes``: images/s, the driver's CPU ms per image, scaling."""
    import ray

    rows: list[dict] = []
    for count in nodes:
        with _cluster(count, node_cpus) as (cluster, _):
            ray.init(address=cluster.address, log_to_driver=False)
            try:
                seconds, driver_cpu = _timed_runs(src, options, count, repeats, scratch)
            finally:
                ray.shutdown()
        rate = images / statistics.median(seconds)
        one = rows[0]["images_per_s"] / rows[0]["nodes"] if rows else rate / count
        rows.append({"mode": mode, "source": "tree", "workers": f"ray {count}", "nodes": count,
                     "node_cpus": node_cpus, "images": images, "seconds": seconds, "images_per_s": rate,
                     "scaling_efficiency": rate / (count * one),
                     "driver_cpu_ms_per_image": 1000 * statistics.median(driver_cpu) / images})
        print(f"{mode:<12} ray {count} node(s) of {node_cpus} core: {rate:7.0f} images/s, "
              f"{rows[-1]['scaling_efficiency']:.2f} of linear, driver "
              f"{rows[-1]['driver_cpu_ms_per_image']:.3f} CPU ms/image (median of {repeats})")
    return rows


def _timed_runs(src: Path, options: dict, count: int, repeats: int, scratch: Path) -> tuple[list[float], list[float]]:
    seconds, driver_cpu = [], []
    for attempt in range(repeats + 1):
        out = scratch / f"ray-{count}-{attempt}"
        started, cpu_started = time.perf_counter(), _own_cpu_s()
        shard(ShardConfig(src, out, ray="auto", **options))  # the connection made above
        if attempt > 0:
            seconds.append(time.perf_counter() - started)
            driver_cpu.append(_own_cpu_s() - cpu_started)
        shutil.rmtree(out)
    return seconds, driver_cpu
