"""``feeder shard SRC OUT --ray ADDRESS``: the connection to a Ray cluster whose nodes
read, normalise and write the shards (``sharder.ray_shards``).

This process (the driver) lists SRC and makes the seeded global order once, as a
local run does; the tasks read their inputs where they lie (a shared file system,
the image-net.org tars, an object store) and write OUT, which every node must reach.
The output is byte-identical to a one-machine run with the same seed, whatever the
number of nodes and tasks.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from core.errors import ConfigError

__all__ = ["RayTasks", "connect"]

log = logging.getLogger(__name__)

# Tasks of each kind in flight per CPU of the cluster when ``--ray-tasks-per-node`` is
# not given. Sizes are taken in order, so a node done with its tasks while the oldest
# one still runs elsewhere idles until it is taken; four keep the nodes' queues from
# running dry behind a slow task.
_TASKS_PER_CPU = 4


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'feeder[ray]'") from e
    return ray


class RayTasks:
    """A connected Ray cluster and how many tasks to keep in flight on it.

    Args:
        ray: the ``ray`` module, connected.
        tasks_per_node: tasks in flight per live node (a node runs as many at once
            as it has CPUs, the rest wait placed); None: four per CPU of the cluster.
    """

    def __init__(self, ray: Any, tasks_per_node: int | None) -> None:
        self.ray = ray
        self.nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        wanted = _TASKS_PER_CPU * cpus if tasks_per_node is None else tasks_per_node * self.nodes
        self.in_flight = max(1, wanted)


# How long a cluster's address may take to accept a connection: Ray itself waits
# minutes for one that never answers.
_ANSWER_TIMEOUT_S = 10.0


def _check_answers(address: str) -> None:
    """Raises ConfigError where ``address`` (HOST:PORT) accepts no connection."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return  # ``auto``, ``local``, a ray:// client address: Ray resolves them, failing fast
    try:
        socket.create_connection((host, int(port)), timeout=_ANSWER_TIMEOUT_S).close()
    except OSError as e:
        raise ConfigError(f"--ray {address}: no Ray cluster answers there ({e.strerror or e})") from e


@contextmanager
def connect(address: str, tasks_per_node: int | None) -> Iterator[RayTasks]:
    """Tasks on the Ray cluster at ``address`` (``auto``: the one this node belongs
    to, or ``RAY_ADDRESS``; ``local``: a cluster of this machine alone, started here
    and stopped at the end), disconnected when the run ends. The tasks get this
    process's ``AWS_*`` variables, so a store SRC is read with the same settings.
    Where this process is connected to Ray already (a Ray program calling
    ``sharder.shard``), that connection is used and left open.

    Raises:
        ConfigError: Ray is not installed, or no cluster answers at ``address``.
    """
    ray = _ray()
    if ray.is_initialized():  # a Ray program sharding: its connection, left open
        yield RayTasks(ray, tasks_per_node)
        return
    _check_answers(address)
    local = {"include_dashboard": False} if address == "local" else {}
    # The tasks talk to a store SRC as this process would: with its AWS_* settings.
    store_settings = {name: value for name, value in os.environ.items() if name.startswith("AWS_")}
    try:
        ray.init(address=None if address == "local" else address, log_to_driver=False,
                 runtime_env={"env_vars": store_settings}, **local)
    except ConnectionError as e:
        raise ConfigError(f"--ray {address}: no Ray cluster answers there: {e}") from e
    try:
        tasks = RayTasks(ray, tasks_per_node)
        log.info("sharding on Ray at %s: %d nodes, %d tasks in flight", address, tasks.nodes, tasks.in_flight)
        yield tasks
    finally:
        ray.shutdown()

