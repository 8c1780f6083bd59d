"""Fixtures for the client tests: real sample shards, an in-process daemon on port 0,
and a runner for the trainer under torchrun (two CPU ranks, gloo)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
from tests.common.env import child_env
from tests.common.shards import build_sample_shards

ROOT = Path(__file__).resolve().parents[2]
CLASSES = 4
TRAIN_PER_CLASS = 32
VAL_PER_CLASS = 8
N_TRAIN = CLASSES * TRAIN_PER_CLASS
N_VAL = CLASSES * VAL_PER_CLASS


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("client-shards"), classes=CLASSES,
                               train_per_class=TRAIN_PER_CLASS, val_per_class=VAL_PER_CLASS)


def start_daemon(shards: Path, port: int = 0) -> tuple[FeederServer, int]:
    config = ServerConfig(datasets={"sample": shards}, port=port, device="cpu", threads=1,
                          max_batch_size=64, grace_s=0.5)
    return create_server(config)


@pytest.fixture(scope="module")
def daemon(shards: Path) -> Iterator[str]:
    server, port = start_daemon(shards)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


def _trainer_command(address: str, args: tuple[str, ...], nproc: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", "clients.train", "--server", address,
            "--dataset", "sample", "--device", "cpu", "--log-every-steps", "0", *args]


def _trainer_env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1")


def run_trainer(address: str, *args: str, nproc: int = 2,
                timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node N -m clients.train --server ADDRESS ...`` on CPU."""
    return subprocess.run(_trainer_command(address, args, nproc), env=_trainer_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def kill_trainer_when(address: str, *args: str, ready: Callable[[], bool], nproc: int = 2,
                      timeout_s: float = 240) -> int:
    """Run the trainer as :func:`run_trainer` does and SIGKILL all its processes (torchrun
    and every rank, at once) as soon as ``ready()`` is true, as a crash would; returns the exit
    status (negative: killed; 0: it finished before ``ready()`` held)."""
    proc = subprocess.Popen(_trainer_command(address, args, nproc), env=_trainer_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                _kill_tree(proc.pid)
                break
            time.sleep(0.01)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            _kill_tree(proc.pid)
            proc.wait()


def _kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process descended from it (torchrun starts its ranks
    in sessions of their own, so a process group does not reach them)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree.update(children)
        frontier = children
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
