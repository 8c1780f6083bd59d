"""The loader's and the trainer's test data: small real sample shards (4 classes) and
an in-process daemon on port 0 serving them as ``sample`` on the CPU."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
from tests.common.shards import build_sample_shards

__all__ = ["CLASSES", "N_TRAIN", "N_VAL", "build_client_shards", "start_daemon"]

CLASSES = 4
TRAIN_PER_CLASS = 32
VAL_PER_CLASS = 8
N_TRAIN = CLASSES * TRAIN_PER_CLASS
N_VAL = CLASSES * VAL_PER_CLASS


def build_client_shards(folder: Path) -> Path:
    """Sample shards of ``N_TRAIN`` train and ``N_VAL`` val images under ``folder``."""
    return build_sample_shards(folder, classes=CLASSES, train_per_class=TRAIN_PER_CLASS,
                               val_per_class=VAL_PER_CLASS)


def start_daemon(shards: Path, port: int = 0) -> tuple[FeederServer, int]:
    """A daemon serving ``shards`` as ``sample``; ``port`` 0: any free port."""
    config = ServerConfig.of(datasets={"sample": shards}, port=port, device="cpu", threads=1,
                          max_batch_size=64, grace_s=0.5)
    return create_server(config)


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The sample shards (a conftest that imports this fixture gets its own copy)."""
    return build_client_shards(tmp_path_factory.mktemp("client-shards"))


@pytest.fixture(scope="module")
def daemon(shards: Path) -> Iterator[str]:
    """An in-process daemon over ``shards`` on port 0: its address."""
    server, port = start_daemon(shards)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)

