"""The one GPU inventory: UUIDs matched whichever way they are written, an empty
inventory without CUDA (in a process that sees no device, whatever the machine has),
and on a GPU machine the devices torch and nvidia-smi name."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from core.gpus import Gpu, GpuInventory, find_device, normalise_uuid, visible_uuids
from tests.common.env import child_env

NVML = "GPU-5f3a0c1e-aaaa-4bbb-8ccc-0123456789ab"
OTHER = "GPU-00000000-0000-0000-0000-000000000000"


def test_device_uuids_match_whichever_way_they_are_written():
    assert normalise_uuid(NVML.removeprefix("GPU-").upper()) == NVML  # torch prints no prefix
    assert normalise_uuid("MIG-ABC") == "MIG-abc"
    assert find_device(NVML[4:], [OTHER, NVML]) == 1
    assert find_device("", [NVML]) is None and find_device(NVML, []) is None


def test_an_inventory_finds_its_devices_by_uuid_and_holds_them_normalised():
    gpus = GpuInventory.of_uuids([OTHER, NVML.removeprefix("GPU-").upper()])
    assert gpus.gpus == (Gpu(0, OTHER), Gpu(1, NVML)) and gpus.uuids == (OTHER, NVML) and len(gpus) == 2
    assert gpus.find(NVML) == 1 and gpus.find(NVML.upper()) == 1 and gpus.find("GPU-ffff") is None
    assert gpus.find("") is None


@pytest.mark.slow
def test_the_inventory_without_cuda_is_empty_and_nothing_raises():
    """A child that sees no device (CUDA_VISIBLE_DEVICES empty: true on a GPU machine
    too) gets empty inventories from every user of it: the CUDA IPC transport says it
    is unavailable, as the daemon's fallback expects."""
    code = (
        "from core.gpus import GpuInventory, visible_uuids\n"
        "from transport.base import TransportUnavailable\n"
        "from transport.cuda_ipc import device_index, visible_uuids as old_name\n"
        "gpus = GpuInventory.of_this_process()\n"
        "assert len(gpus) == 0 and gpus.uuids == () and gpus.find('GPU-0') is None\n"
        "assert visible_uuids() == [] and old_name() == []\n"
        "try:\n"
        "    device_index('GPU-00000000-0000-0000-0000-000000000000')\n"
        "except TransportUnavailable as e:\n"
        "    print('unavailable:', e)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], env=child_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "unavailable: CUDA IPC: no CUDA device in this process"


def test_the_transport_s_old_names_are_the_inventory_s():
    from core import gpus
    from transport import cuda_ipc

    for name in ("device_uuid", "find_device", "normalise_uuid", "visible_uuids"):
        assert getattr(cuda_ipc, name) is getattr(gpus, name)


@pytest.mark.gpu
def test_the_inventory_is_the_devices_torch_sees_by_index():
    import torch

    gpus = GpuInventory.of_this_process()
    assert len(gpus) == torch.cuda.device_count() > 0
    for gpu in gpus.gpus:
        assert gpu.uuid == normalise_uuid(str(torch.cuda.get_device_properties(gpu.index).uuid))
        assert gpu.uuid.startswith(("GPU-", "MIG-")) and gpus.find(gpu.uuid[4:].upper()) == gpu.index
    assert visible_uuids() == list(gpus.uuids)


@pytest.mark.gpu
@pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no nvidia-smi")
def test_the_inventory_names_gpus_as_nvidia_smi_does():
    listed = subprocess.run(["nvidia-smi", "--query-gpu=uuid", "--format=csv,noheader"], capture_output=True,
                            text=True, timeout=60, check=True).stdout.split()
    gpus = GpuInventory.of_this_process()
    if any(uuid.startswith("MIG-") for uuid in gpus.uuids):
        pytest.skip("MIG devices: nvidia-smi --query-gpu lists their parents")
    assert set(gpus.uuids) <= set(listed)  # CUDA_VISIBLE_DEVICES may hide some
