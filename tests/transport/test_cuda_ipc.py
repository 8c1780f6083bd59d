"""CUDA IPC across two real processes (needs a CUDA device)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from tests.transport.conftest import make_batch
from transport.base import TransportConfig

ROOT = Path(__file__).resolve().parents[2]

_CLIENT = """
import sys
from pathlib import Path
import torch
from transport.cuda_ipc import CudaIpcReceiver
from transport.grpc_payload import parse_batch
released = []
receiver = CudaIpcReceiver(lambda ref, after=None: released.append((ref.index, ref.generation)))
batch = receiver.receive(parse_batch(Path(sys.argv[1]).read_bytes()))
assert batch.images.device.type == "cuda"
total = int(batch.images.sum())  # ordered after the daemon's write by the slot's event
batch.release(torch.cuda.Event())
print(total, batch.images.device.index, released)
"""


@pytest.mark.gpu
def test_batch_arrives_on_the_clients_device_without_a_host_copy(tmp_path):
    import torch

    from transport.cuda_ipc import CudaIpcSender, device_uuid

    sender = CudaIpcSender("feeder-1-ab-1", TransportConfig(ring_slots=2), 4 * 8 * 8 * 3, device_uuid(0))
    pixels, meta = make_batch()
    slot = sender.slot_for(pixels.shape)
    assert slot.tensor.device == torch.device("cuda", 0)
    slot.tensor.copy_(torch.from_numpy(pixels).to(slot.tensor.device))
    (tmp_path / "msg").write_bytes(sender.message(slot, meta))
    out = subprocess.run(
        [sys.executable, "-c", _CLIENT, str(tmp_path / "msg")],
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    total, device, released = out.stdout.split(maxsplit=2)
    assert int(total) == int(np.asarray(pixels, dtype=np.int64).sum()) and device == "0"
    assert released.strip() == f"[({slot.index}, {slot.generation})]"
    sender.release(slot.index, slot.generation)
    sender.close()


@pytest.mark.gpu
def test_unknown_device_uuid_is_unavailable():
    from transport.base import TransportUnavailable
    from transport.cuda_ipc import device_index

    with pytest.raises(TransportUnavailable):
        device_index("GPU-00000000-0000-0000-0000-000000000000")


def test_device_uuids_match_whichever_way_they_are_written():
    from transport.cuda_ipc import find_device, normalise_uuid

    nvml = "GPU-5f3a0c1e-aaaa-4bbb-8ccc-0123456789ab"
    assert normalise_uuid(nvml.removeprefix("GPU-").upper()) == nvml  # torch prints no prefix
    assert normalise_uuid("MIG-ABC") == "MIG-abc"
    assert find_device(nvml[4:], ["GPU-00000000-0000-0000-0000-000000000000", nvml]) == 1
    assert find_device("", [nvml]) is None and find_device(nvml, []) is None
