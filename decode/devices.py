"""Where a stream's pipeline runs, and how many CPU threads it gets.

A GPU rank names its device by UUID in the request (``ClientHost.gpu_uuid``): device
indices differ per process with ``CUDA_VISIBLE_DEVICES``, UUIDs do not. The daemon
finds that UUID among the devices it sees and builds the stream's pipeline there, so
the batch is decoded on the GPU that trains on it and handed over through CUDA IPC
without a trip through host memory. A request naming a GPU the daemon cannot see (a
client on another host, a daemon started with fewer devices) runs on the daemon's
GPU 0 instead, with one warning per UUID, never an error.

``feeder serve --threads`` is the node's CPU budget for all pipelines together: see
:func:`thread_share`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from core.errors import ConfigError
from core.gpus import GpuInventory, find_device

__all__ = ["DevicePlacer", "Placement", "cuda_devices", "hw_decoder_load_for", "resolve_device", "thread_share"]

log = logging.getLogger(__name__)


def cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA): the size of its
    :class:`~core.gpus.GpuInventory`."""
    return len(GpuInventory.of_this_process())


def resolve_device(device: str, gpus: GpuInventory | None = None) -> str:
    """``auto`` -> ``gpu`` when the process sees a CUDA device (``gpus``, else asked
    now), else ``cpu``.

    Raises:
        ConfigError: ``gpu`` asked for on a machine without one.
    """
    if device == "cpu":
        return device
    count = len(gpus if gpus is not None else GpuInventory.of_this_process())
    if device == "auto":
        return "gpu" if count > 0 else "cpu"
    if device == "gpu" and count == 0:
        raise ConfigError("device: gpu asked for, but no CUDA device is visible (use auto or cpu)")
    return device


@dataclass(frozen=True)
class Placement:
    """Where one stream's pipeline runs.

    Attributes:
        device: ``"cpu"`` or ``"gpu"``.
        device_id: CUDA index in the daemon's process (0 on the CPU).
        gpu_uuid: the client's GPU, as the request wrote it, when the pipeline runs
            on it (its batches may stay on the device); empty otherwise.
    """

    device: str
    device_id: int = 0
    gpu_uuid: str = ""


class DevicePlacer:
    """Maps a request's GPU UUID to one of the daemon's devices.

    Args:
        device: the daemon's resolved device, ``"cpu"`` or ``"gpu"``.
        uuids: UUIDs of the daemon's CUDA devices, by index (its
            :class:`~core.gpus.GpuInventory`: see :meth:`of_this_process`).
    """

    def __init__(self, device: str, uuids: Sequence[str] = (), majors: Sequence[int] = ()) -> None:
        self.device = device
        self.uuids = tuple(uuids)
        self.majors = tuple(majors)  # each device's compute capability major, by index (empty: not known)
        self._warned: set[str] = set()
        self._lock = threading.Lock()

    @classmethod
    def of_this_process(cls, device: str, gpus: GpuInventory | None = None) -> DevicePlacer:
        """A placer over the devices this process sees (``gpus``, else asked now; none
        asked for on the CPU)."""
        if device != "gpu":
            return cls(device)
        uuids = (gpus if gpus is not None else GpuInventory.of_this_process()).uuids
        return cls(device, uuids, _capability_majors(len(uuids)))

    def hw_decoder_load(self, device_id: int, given: float | None = None) -> float:
        """``given``, or the hardware JPEG engines' share for device ``device_id``
        (:func:`hw_decoder_load_for` its compute capability; DALI's default where
        it is not known)."""
        if given is not None:
            return given
        if 0 <= device_id < len(self.majors):
            return hw_decoder_load_for(self.majors[device_id])
        return _DALI_HW_DECODER_LOAD

    @property
    def gpu_count(self) -> int:
        """GPUs pipelines may run on (0 for a CPU daemon)."""
        return len(self.uuids) if self.device == "gpu" else 0

    def place(self, gpu_uuid: str) -> Placement:
        """The device of a stream whose client trains on ``gpu_uuid`` ("" for a CPU
        client): that GPU when the daemon sees it, else the daemon's GPU 0 (or the
        CPU, for a CPU daemon)."""
        if self.device != "gpu":
            return Placement("cpu")
        index = find_device(gpu_uuid, self.uuids)
        if index is not None:
            return Placement("gpu", index, gpu_uuid)
        if gpu_uuid:
            self._warn_once(gpu_uuid)
        return Placement("gpu", 0)

    def _warn_once(self, gpu_uuid: str) -> None:
        with self._lock:
            first = gpu_uuid not in self._warned
            self._warned.add(gpu_uuid)
        log.log(logging.WARNING if first else logging.DEBUG,
                "client GPU %s is not visible to this daemon (it sees %d); its pipeline runs on GPU 0 "
                "and its batches go through host memory", gpu_uuid, len(self.uuids))


def thread_share(budget: int, pipelines: int) -> int:
    """DALI CPU threads of a pipeline when ``pipelines`` share a budget of ``budget``
    threads: an equal whole share, at least 1 (so past ``budget`` pipelines the
    budget is exceeded rather than a stream starved).

    The daemon counts the open streams plus the one being opened, and on a GPU node
    at least one pipeline per GPU for a GPU rank (its ranks start together; the
    first must not take the whole budget). A pipeline keeps its share for its life:
    DALI fixes the thread count when it builds a pipeline.
    """
    return max(1, budget // max(1, pipelines))


# DALI's own hw_decoder_load default, set on the A100 (NVIDIA Ampere).
_DALI_HW_DECODER_LOAD = 0.65
# On Hopper (compute capability 9) and Blackwell (10, 12) the hardware JPEG engines
# outpace the rest of the pipeline: NVIDIA's MLPerf ResNet-50 runs on H100 and H200
# give them 0.99 of the data.
_ENGINES_FIRST_FROM_MAJOR = 9


def hw_decoder_load_for(capability_major: int) -> float:
    """The share of a batch's JPEG data for the hardware JPEG engines of a GPU of
    compute capability ``capability_major`` (ignored by DALI on a GPU without them)."""
    return 0.99 if capability_major >= _ENGINES_FIRST_FROM_MAJOR else _DALI_HW_DECODER_LOAD



def _capability_majors(count: int) -> list[int]:
    """The compute capability major of this process's first ``count`` CUDA devices;
    empty where CUDA cannot say (no driver: an inventory described, not probed)."""
    try:
        import torch

        if torch.cuda.device_count() < count:
            return []
        return [torch.cuda.get_device_capability(i)[0] for i in range(count)]
    except (ImportError, RuntimeError, AssertionError):
        return []
