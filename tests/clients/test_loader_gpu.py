"""GPU ranks and a GPU daemon in another process (CUDA IPC cannot open a handle in the
process that made it): each rank's batches are decoded on the rank's own GPU and
arrive there through CUDA IPC, without a trip through host memory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import torch

from clients import FeederLoader
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_daemon(shards: Path) -> Iterator[str]:
    options = ("--device", "gpu", "--threads", "4", "--max-batch-size", "64")
    with DaemonProcess({"sample": shards}, options, cwd=ROOT) as daemon:
        yield daemon.address


def _stats(address: str) -> feeder_pb2.StatsResponse:
    with grpc.insecure_channel(address) as channel:
        return feeder_pb2_grpc.FeederStub(channel).GetStats(feeder_pb2.StatsRequest(), timeout=10)


def _loader(address: str, device: str, rank: int = 0, world_size: int = 1, **options) -> FeederLoader:
    base = dict(split="val", augment="val", batch_size=4, image_size=64, rank=rank, world_size=world_size,
                device=device, normalize=False, job_id=f"gpu-{world_size}")
    return FeederLoader("sample", address=address, **(base | options))


def test_batches_arrive_on_the_ranks_gpu_without_a_host_copy(gpu_daemon):
    index = torch.cuda.device_count() - 1  # a rank not on device 0 where there is one
    before = _stats(gpu_daemon)
    with _loader(gpu_daemon, f"cuda:{index}") as loader:
        batches = [images for images, _ in loader]
        assert loader.transport == "cuda_ipc"
    assert batches and {b.device for b in batches} == {torch.device("cuda", index)}
    assert all(tuple(b.shape) == (4, 3, 64, 64) and b.dtype == torch.uint8 for b in batches)
    after = _stats(gpu_daemon)
    assert after.gpu_batches - before.gpu_batches >= len(batches)
    assert after.gpu_host_copies == before.gpu_host_copies  # the daemon wrote every one on the device


def test_cuda_ipc_batches_equal_those_sent_inline(gpu_daemon):
    # Same GPU, same inputs: the inline copy went through host memory, the IPC one not.
    with _loader(gpu_daemon, "cuda:0", normalize=True) as loader:
        over_ipc = [images.cpu() for images, _ in loader]
        assert loader.transport == "cuda_ipc"
    with _loader(gpu_daemon, "cuda:0", normalize=True, transport="grpc") as loader:
        inline = [images.cpu() for images, _ in loader]
    assert len(over_ipc) == len(inline) > 0
    for a, b in zip(over_ipc, inline, strict=True):
        assert (a - b).abs().mean() < 0.05  # normalised units; decoder rounding only


def test_two_ranks_on_two_gpus(gpu_daemon):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA devices")
    before = _stats(gpu_daemon)
    loaders = [_loader(gpu_daemon, f"cuda:{rank}", rank=rank, world_size=2, return_keys=True) for rank in (0, 1)]
    try:
        seen = [[(images.device, keys) for images, _, keys in loader] for loader in loaders]
        assert [loader.transport for loader in loaders] == ["cuda_ipc", "cuda_ipc"]
    finally:
        for loader in loaders:
            loader.close()
    for rank, batches in enumerate(seen):
        assert batches and {device for device, _ in batches} == {torch.device("cuda", rank)}
    keys = [set(k for _, ks in batches for k in ks) for batches in seen]
    assert keys[0] and keys[1] and not keys[0] & keys[1]  # disjoint parts of the epoch
    assert _stats(gpu_daemon).gpu_host_copies == before.gpu_host_copies
