"""Test data made once for every pytest-xdist worker of a run: a session fixture is
made once per worker, and the workers of one run share the parent of their base
temporary directories. A file lock lets the first worker make it and the others wait
for it; the name says what it holds (the arguments it was made with), so that data
made otherwise never answers for it."""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

__all__ = ["made_once"]


def _run_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    base = tmp_path_factory.getbasetemp()
    # Under xdist each worker's base is <run>/popen-gwN; alone, the base is the run's.
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def made_once(tmp_path_factory: pytest.TempPathFactory, name: str, make: Callable[[Path], object]) -> Path:
    """``<run>/shared/<name>``, made by ``make(path)`` (which creates ``path``) by the
    first worker that asks; the others wait for it. Tests only read it."""
    folder = _run_dir(tmp_path_factory) / "shared"
    folder.mkdir(exist_ok=True)
    path, done = folder / name, folder / f"{name}.done"
    with open(folder / f"{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed, or the worker dies
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)  # what a worker that failed making it left
            make(path)
            done.touch()
    return path
