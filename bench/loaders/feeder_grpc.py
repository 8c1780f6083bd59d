"""``feeder-grpc``: ``feeder serve`` in a process of its own, consumed over gRPC.

The daemon is started once (``open_shared``) with the thread budget as its DALI
threads; each consumer is a ``clients.FeederLoader`` for its rank, as a training
process uses it, epoch after epoch, kept as uint8 on the CPU (``normalize=False``: the
other loaders stop at uint8 too; both DALI loaders hand over host memory). The daemon
is a child of the loader's process, so its CPU time and memory are charged to this
loader.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager

from bench.loaders.base import Batch, LoaderSpec, dtype_name
from clients import FeederLoader

__all__ = ["DATASET", "open_loader", "open_shared"]

DATASET = "bench"
_READY = "feeder: serving on "
# Seconds the daemon gets to open the shards and bind, and to stop on SIGTERM.
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 15.0
_LOG_LINES = 20


def _daemon_command(spec: LoaderSpec) -> list[str]:
    return [
        sys.executable, "-m", "feeder", "serve", "--dataset", f"{DATASET}={spec.shards}", "--port", "0",
        "--device", spec.device, "--threads", str(spec.threads), "--max-batch-size", str(spec.batch_size),
    ]


def _wait_for_address(proc: subprocess.Popen, log: deque) -> str:
    """Reads the daemon's output until it says where it listens; keeps draining after."""
    found: list[str] = []
    ready = threading.Event()

    def drain() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            log.append(line.rstrip())
            if line.startswith(_READY) and not found:
                found.append(line[len(_READY) :].strip())
                ready.set()
        ready.set()  # the daemon exited before it was ready

    threading.Thread(target=drain, name="feeder-daemon-log", daemon=True).start()
    if not ready.wait(_START_TIMEOUT_S) or not found:
        raise RuntimeError("feeder serve did not start: " + " | ".join(list(log)[-3:]))
    return found[0]


@contextmanager
def open_shared(spec: LoaderSpec) -> Iterator[str]:
    """Starts ``feeder serve`` on a free port; yields its ``host:port``; stops it after."""
    log: deque = deque(maxlen=_LOG_LINES)
    proc = subprocess.Popen(_daemon_command(spec), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        yield _wait_for_address(proc, log)
    finally:
        proc.terminate()
        try:
            proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def _batches(loader: FeederLoader) -> Iterator[Batch]:
    while True:  # each pass over the loader is the rest of one epoch
        for images, _ in loader:
            yield Batch(len(images), images, "NCHW", dtype_name(images))


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NCHW batches streamed by the daemon at ``shared``.

    Raises:
        ValueError: ``shared`` is not a daemon address (``open_shared`` was not run).
    """
    if not isinstance(shared, str):
        raise ValueError("feeder-grpc needs the address of a running daemon (open_shared)")
    loader = FeederLoader(
        shared, DATASET, split=spec.split, batch_size=spec.batch_size, image_size=spec.image_size_px,
        seed=spec.seed, rank=spec.client_rank, world_size=spec.clients, device="cpu", normalize=False,
        augment="train", job_id="bench",
    )
    with loader:
        yield _batches(loader)
