"""Process-group setup for the trainer: NCCL with CUDA, gloo without, same command.
Under ``torchrun`` the ranks come from its environment; run plainly, world size 1."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Dist", "all_gather_objects", "all_reduce_sum", "barrier", "init_distributed", "shutdown_distributed"]


@dataclass(frozen=True)
class Dist:
    """Where this process stands in the job.

    Attributes:
        rank: Global rank.
        world_size: Ranks in the job.
        local_rank: Rank on this node (picks the CUDA device).
        device: This rank's device.
        control: A gloo process group of its own for agreements on host values (a
            stop request) that must not wait on the GPU, nor interleave with the
            gradients' all-reduces; None for a single rank.
    """

    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    control: object | None = None  # a gloo group for host-side agreements (None: the default group)

    @property
    def is_main(self) -> bool:
        """True on rank 0, the one that logs and writes shared files."""
        return self.rank == 0


def init_distributed(device: str = "auto") -> Dist:
    """Joins the process group torchrun describes (if any) and picks the device.

    Args:
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
    """
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    use_cuda = torch.cuda.is_available() if device == "auto" else device == "cuda"
    if use_cuda:
        torch.cuda.set_device(local_rank)
        where = torch.device("cuda", local_rank)
    else:
        where = torch.device("cpu")
    control = None
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group("nccl" if use_cuda else "gloo")
        control = dist.new_group(backend="gloo")  # every rank makes it, in the same order
    return Dist(rank, world_size, local_rank, where, control)


def shutdown_distributed() -> None:
    """Leaves the process group, if one was joined."""
    if dist.is_initialized():
        dist.destroy_process_group()


def barrier() -> None:
    """Waits for every rank (no-op alone)."""
    if dist.is_initialized():
        dist.barrier()


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over all ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor)
    return tensor.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """Element-wise maximum of ``values`` over all ranks."""
    tensor = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor.tolist()


def all_gather_objects(value: object) -> list[object]:
    """``value`` of every rank, rank 0 first (``[value]`` alone)."""
    if not dist.is_initialized():
        return [value]
    gathered: list[object] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, value)
    return gathered
