"""Fixtures for the transport tests: a private shm directory, batches to send."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from protocol.batch import BatchMeta
from transport.base import TransportConfig


@pytest.fixture
def shm_dir() -> Iterator[Path]:
    """A directory on the real /dev/shm tmpfs (tmp otherwise), removed afterwards."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    path = Path(tempfile.mkdtemp(prefix="feeder-test-", dir=base))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def config(shm_dir: Path) -> TransportConfig:
    return TransportConfig(shm_dir=shm_dir, ring_slots=2, slot_wait_s=0.2, head_reserve_bytes=4096)


def make_batch(n: int = 4, side: int = 8, seed: int = 0) -> tuple[np.ndarray, BatchMeta]:
    """Random pixels ``[n, side, side, 3]`` and their small fields."""
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (n, side, side, 3), dtype=np.uint8)
    meta = BatchMeta(
        epoch=2,
        cursor=10 + n,
        samples_per_rank=100,
        keys=[f"key-{seed}-{i}" for i in range(n)],
        labels=np.arange(n, dtype=np.int64) + seed,
        padding=np.arange(n) == n - 1,
    )
    return pixels, meta
