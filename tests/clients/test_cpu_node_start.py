"""On a node without a CUDA driver the daemon, and ``feeder run`` checking its options,
never load torch (a second and a half of CPU to import), nor DALI (half a second) where
the window decoder decodes: paid on each daemon start (a restart after a fault
included) and each launch. torch is the client's; its batches arrive as tensors all
the same."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from clients import FeederLoader
from core.gpus import _DRIVER_NODES
from launcher.daemon_process import DaemonProcess
from shards import jpeg
from tests.common.env import ROOT, child_env

pytestmark = pytest.mark.skipif(any(node.exists() for node in _DRIVER_NODES),
                                reason="a CUDA driver is here: the daemon asks torch for its GPUs")


def _loaded(pid: int, library: str) -> bool:
    return any(library in line for line in Path(f"/proc/{pid}/maps").read_text().splitlines())


@pytest.mark.slow
@pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))
def test_a_daemon_serving_batches_over_each_transport_has_loaded_neither_torch_nor_dali(shards: Path):
    # --device left to auto, as a user leaves it: it finds no GPU without asking torch.
    with DaemonProcess({"sample": shards}, ("--threads", "1"), cwd=ROOT) as daemon:
        for transport in ("shm", "grpc"):
            with FeederLoader(address=daemon.address, dataset="sample", batch_size=8, image_size=32, rank=0,
                              world_size=1, transport=transport) as loader:
                images, labels = next(iter(loader))
            assert isinstance(images, torch.Tensor) and images.shape == (8, 3, 32, 32), transport
        assert _loaded(daemon.pid, "shards/_jpeg"), "the window decoder decoded them (the check reads its maps)"
        assert not _loaded(daemon.pid, "libtorch") and not _loaded(daemon.pid, "libdali")


@pytest.mark.slow
def test_a_daemon_decoding_with_dali_loads_it_when_it_builds_its_first_pipeline(shards: Path):
    with DaemonProcess({"sample": shards}, ("--threads", "1", "--cpu-decoder", "dali"), cwd=ROOT) as daemon:
        assert not _loaded(daemon.pid, "libdali")
        with FeederLoader(address=daemon.address, dataset="sample", batch_size=8, image_size=32, rank=0,
                          world_size=1) as loader:
            images, _ = next(iter(loader))
        assert images.shape == (8, 3, 32, 32) and _loaded(daemon.pid, "libdali")


def test_feeder_run_refusing_an_option_has_imported_neither_torch_nor_dali():
    probe = ("import runpy, sys\n"
             "sys.argv = ['feeder', 'run', '--dataset', 'sample=/nowhere', '--restarts', '-1', '--', 'true']\n"
             "try:\n"
             "    runpy.run_module('feeder', run_name='__main__')\n"
             "except SystemExit as e:\n"
             "    print(e.code, 'torch' in sys.modules, 'nvidia.dali' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                          timeout=60)
    assert done.stdout.split() == ["1", "False", "False"], done.stdout + done.stderr
    assert "restarts: must be >= 0" in done.stderr
