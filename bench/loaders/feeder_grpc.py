"""``feeder-grpc``: ``feeder serve`` in a process of its own, consumed over gRPC.

The daemon is started once (``open_shared``) with the thread budget as its DALI
threads; each consumer opens ``StreamBatches`` for its rank, epoch after epoch, and
turns every message into a uint8 NHWC array, as a training process would before moving
it to its device. The daemon is a child of the loader's process, so its CPU time and
memory are charged to this loader.
"""

from __future__ import annotations

import subprocess
import sys
import threading
from collections import deque
from collections.abc import Iterator
from contextlib import contextmanager
from itertools import count

import grpc
import numpy as np

from bench.loaders.base import Batch, LoaderSpec
from protos import feeder_pb2, feeder_pb2_grpc

__all__ = ["DATASET", "open_loader", "open_shared"]

DATASET = "bench"
_READY = "feeder: serving on "
# Seconds the daemon gets to open the shards and bind, and to stop on SIGTERM.
_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 15.0
_LOG_LINES = 20
# Batches are tens of MB at large sizes: lift gRPC's 4 MB receive limit.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1)]


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


def _request(spec: LoaderSpec, epoch: int) -> feeder_pb2.StreamRequest:
    return feeder_pb2.StreamRequest(
        dataset=DATASET, split=spec.split, job_id="bench", seed=spec.seed, epoch=epoch,
        rank=spec.client_rank, world_size=spec.clients, batch_size=spec.batch_size,
        image_size=spec.image_size_px, augment=feeder_pb2.AUGMENT_TRAIN,
    )


def _batches(stub: feeder_pb2_grpc.FeederStub, spec: LoaderSpec) -> Iterator[Batch]:
    for epoch in count():
        for message in stub.StreamBatches(_request(spec, epoch)):
            images = np.frombuffer(message.images, dtype=np.uint8).reshape(tuple(message.shape))
            yield Batch(len(images), images, "NHWC", "uint8")


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches streamed by the daemon at ``shared``.

    Raises:
        ValueError: ``shared`` is not a daemon address (``open_shared`` was not run).
    """
    if not isinstance(shared, str):
        raise ValueError("feeder-grpc needs the address of a running daemon (open_shared)")
    with grpc.insecure_channel(shared, options=_CHANNEL_OPTIONS) as channel:
        yield _batches(feeder_pb2_grpc.FeederStub(channel), spec)
