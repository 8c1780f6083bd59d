"""The GPU check's ``machine`` step: what this machine is and what the check will run
with, printed for the log and written as JSON for the summary.

The card (its name and the lent kind it is: an H200 or an H100 differ in memory
speed, and the first run's absolute figures are an H200's), the CUDA devices torch
sees, the packages the check carries (DALI, grpc, protobuf, pytest-timeout), whether
the native window decoder and the C resize load (without them the split and the CPU
daemons are not what users run), whether NVML reads the hardware JPEG engines, and
nvidia-smi's view.

Example::

    python -m bench.gpu_machine --json /tmp/work/machine.json
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch

from bench.nvml import card_kind, open_reader

__all__ = ["describe", "main"]

_PACKAGES = ("nvidia.dali", "grpc", "google.protobuf", "pytest_timeout")


def _packages() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            module = importlib.import_module(name)
            found[name] = f"{getattr(module, '__version__', '?')} from {getattr(module, '__file__', '?')}"
        except ImportError as e:
            found[name] = f"missing: {e}"
    return found


def _jpeg_counter(uuid: str) -> str:
    """Whether NVML reads the JPEG engines of the card, and what it reads now."""
    reader, reason = open_reader(uuid)
    if reader is None:
        return f"not available: {reason}"
    try:
        _, jpeg = reader.read()
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return f"not available: {e}"
    return f"{jpeg:.0f} % now (from {reader.source})" if jpeg is not None else f"not read: {reader.jpeg_reason}"


def describe() -> dict[str, Any]:
    """This machine as the check sees it."""
    from decode import resize
    from shards import jpeg

    devices = [torch.cuda.get_device_properties(i) for i in range(torch.cuda.device_count())]
    card = devices[0].name if devices else ""
    uuid = f"GPU-{devices[0].uuid}" if devices else ""
    return {
        "card": card or "no CUDA device", "kind": card_kind(card), "cores": os.cpu_count(),
        "python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
        "devices": [f"cuda:{i} {p.name} {p.total_memory >> 30} GiB uuid GPU-{p.uuid}" for i, p in enumerate(devices)],
        "packages": _packages(),
        "window_decoder": jpeg.unavailable_reason() or "loads",
        "c_resize": resize.native_unavailable_reason() or "loads",
        "jpeg_engines": _jpeg_counter(uuid) if devices else "no CUDA device",
    }


def main(argv: list[str] | None = None) -> None:
    """Prints the description (and nvidia-smi) and writes it to ``--json``."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--json", type=Path, help="write the description here")
    args = parser.parse_args(argv)
    described = describe()
    print(f"card: {described['card']} ({described['kind']}), {described['cores']} cores")
    for key, value in described.items():
        if key not in ("card", "kind", "cores"):
            print(f"{key}: {value}")
    if args.json:
        args.json.write_text(json.dumps(described, indent=2) + "\n")
    if shutil.which("nvidia-smi"):
        print(subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=20).stdout)


if __name__ == "__main__":
    main()
