"""The loader and the daemon install without the bundled trainer's extra
(``feeder[trainer]``: torchvision and matplotlib)."""

from __future__ import annotations

import pkgutil
import subprocess
import sys
import tomllib

import pytest

import cli
import clients
import decode
import feeder
import launcher
from tests.common.env import ROOT, child_env
from trainer.commands import EXTRA_MODULES

PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {r.split(">")[0].split("=")[0].split("[")[0].strip() for r in requirements}


def test_torchvision_and_matplotlib_are_the_trainers_extra_only() -> None:
    assert _names(PROJECT["optional-dependencies"]["trainer"]) == set(EXTRA_MODULES)
    assert not _names(PROJECT["dependencies"]) & set(EXTRA_MODULES)
    assert "feeder[trainer]" in PROJECT["optional-dependencies"]["dev"]  # make test runs the trainer's tests


@pytest.mark.slow
def test_every_loader_and_daemon_module_imports_without_them() -> None:
    modules = [f"{package.__name__}.{m.name}" for package in (clients, decode, feeder, launcher, cli)
               for m in pkgutil.iter_modules(package.__path__) if m.name != "__main__"]  # feeder.__main__ runs the CLI
    modules.remove("decode._resize")  # a plain C library (loaded with ctypes), not a module
    blocked = "".join(f"sys.modules[{name!r}] = None;" for name in EXTRA_MODULES)
    script = f"import importlib, sys; {blocked} [importlib.import_module(m) for m in {modules!r}]"
    run = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "cli.app" in modules and "clients.loader" in modules
