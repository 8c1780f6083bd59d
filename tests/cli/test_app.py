"""The ``feeder`` command line starts fast: its help, and each command's, loads none
of Pillow, OpenCV, torch or DALI (every command's options come from configuration
modules that import none of them)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEAVY = {"PIL", "cv2", "torch", "nvidia"}  # nvidia.dali


def _imported(*args: str) -> set[str]:
    """Every module ``python -X importtime ARGS`` imports."""
    run = subprocess.run([sys.executable, "-X", "importtime", *args], cwd=ROOT, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    return {line.rsplit("|", 1)[1].strip() for line in run.stderr.splitlines() if line.startswith("import time:")}


def _heavy(modules: set[str]) -> set[str]:
    return {name for name in modules if name.split(".")[0] in HEAVY}


@pytest.mark.slow
@pytest.mark.parametrize("command", ["", "serve", "shard", "verify", "sample-data", "train"])
def test_help_loads_no_heavy_module(command: str) -> None:
    modules = _imported("-m", "feeder", *command.split(), "--help")
    assert "cli.app" in modules
    assert _heavy(modules) == set()


def test_the_check_sees_a_heavy_import() -> None:
    assert "PIL" in _heavy(_imported("-c", "import PIL.Image"))
