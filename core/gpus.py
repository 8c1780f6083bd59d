"""The GPUs this process sees, named by UUID: the one inventory the daemon (whether
it decodes on a GPU, which of its GPUs a rank trains on), the loader (which GPU it
names in its request) and the CUDA IPC transport (which device a ring lives on) ask.

A GPU is named by UUID, never by index: indices differ per process with
``CUDA_VISIBLE_DEVICES``, UUIDs do not. They are written as nvidia-smi and NVML
write them (``GPU-`` or ``MIG-`` and lower-case hex), whichever way they came in.

The devices are those torch's CUDA runtime sees (DALI's, the pipelines' library,
honour ``CUDA_VISIBLE_DEVICES`` the same way). Without CUDA (no driver, no device, a
CPU build of torch, a driver that fails to start) the inventory is empty: nothing
raises, and callers take their CPU path. torch is imported only when the inventory
is asked for on a machine with a CUDA driver's device node (a CPU node's daemon
starts without it).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Gpu", "GpuInventory", "device_uuid", "find_device", "normalise_uuid", "visible_uuids"]

log = logging.getLogger(__name__)

_UUID_PREFIXES = ("GPU-", "MIG-")
# What the CUDA driver opens: the NVIDIA driver's control node, or WSL's paravirtual
# GPU. Without either there is no device to find, and torch is not imported to say so.
_DRIVER_NODES = (Path("/dev/nvidiactl"), Path("/dev/dxg"))


def normalise_uuid(uuid: str) -> str:
    """``uuid`` as nvidia-smi writes it: ``GPU-`` (or ``MIG-``) and lower-case hex.
    torch's ``device_properties.uuid`` prints without the prefix, NVML with it."""
    uuid = uuid.strip()
    prefix = next((p for p in _UUID_PREFIXES if uuid.upper().startswith(p)), "GPU-")
    body = uuid[len(prefix):] if uuid.upper().startswith(prefix) else uuid
    return prefix + body.lower()


def find_device(uuid: str, uuids: Sequence[str]) -> int | None:
    """Index of ``uuid`` in ``uuids`` (a process's devices, in its index order),
    whichever way either is written; None when it is not there (or ``uuid`` is empty)."""
    if not uuid:
        return None
    wanted = normalise_uuid(uuid)
    return next((i for i, u in enumerate(uuids) if normalise_uuid(u) == wanted), None)


def device_uuid(index: int) -> str:
    """UUID ("GPU-...") of this process's CUDA device ``index`` (which must exist)."""
    import torch

    return normalise_uuid(str(torch.cuda.get_device_properties(index).uuid))


@dataclass(frozen=True)
class Gpu:
    """One CUDA device of this process.

    Attributes:
        index: its CUDA index in this process.
        uuid: its UUID, normalised (see :func:`normalise_uuid`).
    """

    index: int
    uuid: str


@dataclass(frozen=True)
class GpuInventory:
    """The CUDA devices of a process, in its index order (empty: no CUDA).

    Build it with :meth:`of_this_process`, or from UUIDs (:meth:`of_uuids`) for a
    process that is described rather than asked.
    """

    gpus: tuple[Gpu, ...] = ()

    @classmethod
    def of_this_process(cls) -> GpuInventory:
        """The devices this process sees now; empty without CUDA (never raises for that)."""
        return cls.of_uuids(_probe_uuids())

    @classmethod
    def of_uuids(cls, uuids: Sequence[str]) -> GpuInventory:
        """An inventory of devices with these UUIDs, by index."""
        return cls(tuple(Gpu(i, normalise_uuid(u)) for i, u in enumerate(uuids)))

    def __len__(self) -> int:
        return len(self.gpus)

    @property
    def uuids(self) -> tuple[str, ...]:
        """The devices' UUIDs, by index."""
        return tuple(gpu.uuid for gpu in self.gpus)

    def find(self, uuid: str) -> int | None:
        """The index of the device named ``uuid`` (written either way); None when
        this process does not see it, or ``uuid`` is empty."""
        return find_device(uuid, self.uuids)


def visible_uuids() -> list[str]:
    """UUIDs of the CUDA devices this process sees, by index (empty without CUDA)."""
    return list(GpuInventory.of_this_process().uuids)


def _probe_uuids() -> list[str]:
    """torch's CUDA devices, or none where torch, its CUDA build, a driver or a device
    is missing (or the driver fails to start, a ``RuntimeError``)."""
    if not any(node.exists() for node in _DRIVER_NODES):
        return []
    try:
        import torch
    except ImportError:
        return []
    try:
        if not torch.cuda.is_available():
            return []
        return [device_uuid(i) for i in range(torch.cuda.device_count())]
    except RuntimeError as e:  # CUDA present but unusable: the CPU path, said once here
        log.warning("CUDA devices not usable (%s): taking none", (str(e).strip().splitlines() or [""])[0])
        return []
