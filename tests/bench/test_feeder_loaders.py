"""The feeder loaders of the bench measure the transport they name, or nothing."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from bench import throughput
from bench.loaders import feeder_cuda_ipc, feeder_grpc
from bench.loaders.base import LoaderSpec, LoaderUnavailable


class _Loader:
    """What the bench reads of a ``FeederLoader``: its batches and its transport."""

    def __init__(self, transport: str) -> None:
        self.transport = transport

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield torch.zeros((2, 3, 8, 8), dtype=torch.uint8), torch.zeros(2, dtype=torch.int64)


def test_a_batch_over_another_transport_than_asked_for_fails_the_run() -> None:
    with pytest.raises(RuntimeError, match="asked for shm, the batches came over cuda_ipc"):
        next(feeder_grpc._batches(_Loader("cuda_ipc"), "shm"))  # type: ignore[arg-type]
    batch = next(feeder_grpc._batches(_Loader("cuda_ipc"), "cuda_ipc"))  # type: ignore[arg-type]
    assert batch.count == 2 and batch.layout == "NCHW"


@pytest.mark.slow
def test_cuda_ipc_without_a_gpu_is_skipped_with_its_reason(tmp_path: Path, bench_shards: Path) -> None:
    spec = LoaderSpec(shards=bench_shards, source=None, device="cpu")
    with pytest.raises(LoaderUnavailable, match="--device gpu"):
        feeder_cuda_ipc.open_shared(spec)
    argv = ["--data", str(bench_shards), "--loaders", "feeder-cuda-ipc", "--image-size", "32", "--batch-size", "8",
            "--threads", "1", "--seconds", "0.3", "--warmup", "0", "--repeats", "1", "--json", str(tmp_path / "r.json")]
    assert throughput.main(argv) == 0
    (row,) = json.loads((tmp_path / "r.json").read_text())["results"]
    assert row["loader"] == "feeder-cuda-ipc" and "--device gpu" in row["skipped"]
