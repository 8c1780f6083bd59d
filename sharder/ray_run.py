"""``feeder shard SRC OUT --ray ADDRESS``: the images read and normalised by Ray tasks
spread over a cluster's nodes.

This process (the driver) lists SRC and makes the seeded global order once, as a
local run does. Runs of consecutive inputs in that order become Ray tasks; each
carries a reader of its own inputs only (their names and, for tars, their offsets),
reads them where they lie (a shared file system, the image-net.org tars, an object
store) and returns their outcomes. The driver takes the outcomes in order and rolls
them into tars exactly as ``--workers`` does, so the output is byte-identical to a
one-machine run with the same seed, whatever the number of nodes and tasks.

A node that dies costs only the tasks it held: Ray runs them again on another node
(and rebuilds an outcome it lost from the task that made it). A driver that dies is
rerun with the same command and resumes from the shards it finished, as a local run.

The driver's work per image is what a ``--workers`` run's writing process does less
the normalising: receive the outcome, write it into the tar, hash it
(``bench/shard.py --ray-nodes`` reports its CPU time per image).
"""

from __future__ import annotations

import logging
import os
import socket
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from core.errors import ConfigError
from sharder.images import ProcessedImage
from sharder.normalise import process_files
from sharder.source_reads import Source

__all__ = ["RayTasks", "connect"]

log = logging.getLogger(__name__)

# Inputs per task: a task costs Ray about a millisecond to place and return (an
# image's normalising); fewer per task leave less idle at a split's end.
_PER_TASK = 32
# Tasks in flight per CPU of the cluster when ``--ray-tasks-per-node`` is not given.
# Outcomes are taken in order, so a node done with its tasks while the oldest one
# still runs elsewhere idles until it is taken; four (about 1 MB each at 32 inputs
# of ImageNet's size) keep the nodes' queues from running dry behind a slow task.
_TASKS_PER_CPU = 4
# Task retries when a node dies under a task (Ray's own default is 3): a run on a
# cluster losing nodes one by one should still end.
_MAX_RETRIES = 8


def _ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ConfigError("--ray needs Ray, which is not installed: pip install 'feeder[ray]'") from e
    return ray


class RayTasks:
    """Normalises inputs on a Ray cluster, ``tasks_per_node`` tasks in flight per node.

    Args:
        ray: the ``ray`` module, connected.
        tasks_per_node: tasks in flight per live node (a node runs as many at once
            as it has CPUs, the rest wait placed); None: four per CPU of the cluster.
    """

    def __init__(self, ray: Any, tasks_per_node: int | None) -> None:
        self._ray = ray
        self._task = ray.remote(num_cpus=1, max_retries=_MAX_RETRIES)(process_files)
        self.nodes = sum(1 for node in ray.nodes() if node.get("Alive"))
        cpus = int(ray.cluster_resources().get("CPU", 1))
        wanted = _TASKS_PER_CPU * cpus if tasks_per_node is None else tasks_per_node * self.nodes
        self.in_flight = max(1, wanted)

    def outcomes(self, options: tuple, splits: list[tuple[Source, list[str]]]) -> list[Iterator[ProcessedImage]]:
        """Per split of ``splits`` (its reader, its input names), the outcome of each
        input, in order; take the splits' outcomes one split after another. One
        window of tasks runs over them all, so the next split's tasks start while the
        last ones of a split still run (``options``: ``sharder.normalise.options_of``)."""
        window: deque[tuple[int, Any]] = deque()
        sent = self._sent(options, splits)
        return [self._taken(number, window, sent) for number in range(len(splits))]

    def _sent(self, options: tuple, splits: list[tuple[Source, list[str]]]) -> Iterator[tuple[int, Any]]:
        """(split number, task) for each run of inputs, sent as it is asked for."""
        for number, (source, names) in enumerate(splits):
            for start in range(0, len(names), _PER_TASK):
                run = names[start:start + _PER_TASK]
                yield number, self._task.remote(source.for_names(run), run, options)  # its offsets only

    def _taken(self, number: int, window: deque[tuple[int, Any]],
               sent: Iterator[tuple[int, Any]]) -> Iterator[ProcessedImage]:
        while True:
            while len(window) < self.in_flight and (task := next(sent, None)) is not None:
                window.append(task)
            if not window or window[0][0] != number:
                return
            yield from self._ray.get(window.popleft()[1])


# How long a cluster's address may take to accept a connection: Ray itself waits
# minutes for one that never answers.
_ANSWER_TIMEOUT_S = 10.0


def _check_answers(address: str) -> None:
    """Raises ConfigError where ``address`` (HOST:PORT) accepts no connection."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
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

