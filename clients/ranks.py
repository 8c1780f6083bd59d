"""Where a loader runs: its rank and world size, its node's ranks, its device."""

from __future__ import annotations

import os

import torch

from core.errors import ConfigError
from core.gpus import device_uuid
from protocol.request import MAX_WORLD_SIZE

__all__ = ["gpu_uuid", "in_process_group", "local_world_size", "resolve_device", "resolve_rank"]


def _env_int(name: str, default: int) -> int:
    """The whole number in environment variable ``name`` (``default`` unset).

    Raises:
        ConfigError: it is set to something else, naming it.
    """
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return int(text)
    except ValueError as e:
        raise ConfigError(f"{name}={text!r}: not a whole number") from e


def gpu_uuid(device: torch.device) -> str:
    """The CUDA device's UUID (names the GPU whatever CUDA_VISIBLE_DEVICES says);
    empty for a CPU consumer."""
    if device.type != "cuda":
        return ""
    return device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else from torch.distributed, else torchrun's env."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        found = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


def in_process_group(world_size: int) -> bool:
    """Whether this process is a rank of an initialised ``torch.distributed`` group of
    ``world_size`` ranks: one whose steps are collective (DDP), so its ranks take their
    batches together and stand at one cursor whenever they all save their state."""
    return bool(torch.distributed.is_available() and torch.distributed.is_initialized()
                and torch.distributed.get_world_size() == world_size)


def local_world_size(world_size: int) -> int:
    """Ranks of this job on this node: torchrun says; else all of them (a daemon
    serves one node, so a job that does not say is taken to be on it)."""
    return max(0, min(_env_int("LOCAL_WORLD_SIZE", world_size), world_size, MAX_WORLD_SIZE))


def resolve_device(device: str | torch.device) -> torch.device:
    """``device`` as a torch device; ``cuda`` without an index is the current one."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
