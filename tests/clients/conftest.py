"""Fixtures for the client tests: real sample shards, an in-process daemon on port 0,
and a runner for the trainer under torchrun (two CPU ranks, gloo)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
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


def run_trainer(address: str, *args: str, nproc: int = 2,
                timeout_s: float = 240) -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node N -m clients.train --server ADDRESS ...`` on CPU."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(nproc), "-m", "clients.train", "--server", address,
               "--dataset", "sample", "--device", "cpu", "--log-every-steps", "0", *args]
    return subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout_s)
