"""Fixtures for the trainer's tests: the loader's sample shards and daemon
(:mod:`tests.common.sample_daemon`), and a runner for the trainer under torchrun
(CPU ranks, gloo)."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Callable

from tests.common.env import ROOT, child_env
from tests.common.processes import kill_tree
from tests.common.sample_daemon import daemon, shards  # noqa: F401 - fixtures


def trainer_command(address: str, args: tuple[str, ...], nproc: int, module: str = "trainer.train") -> list[str]:
    """torchrun's command line for ``module`` (the trainer's command) against ``address``."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            "--nproc-per-node", str(nproc), "-m", module, "--server", address,
            "--dataset", "sample", "--device", "cpu", "--log-every-steps", "0", *args]


def trainer_env() -> dict[str, str]:
    return child_env(OMP_NUM_THREADS="1")


def run_trainer(address: str, *args: str, nproc: int = 2, timeout_s: float = 240,
                module: str = "trainer.train") -> subprocess.CompletedProcess[str]:
    """``torchrun --nproc-per-node N -m trainer.train --server ADDRESS ...`` on CPU."""
    return subprocess.run(trainer_command(address, args, nproc, module), env=trainer_env(), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)


def kill_trainer_when(address: str, *args: str, ready: Callable[[], bool], nproc: int = 2,
                      timeout_s: float = 240) -> int:
    """Run the trainer as :func:`run_trainer` does and SIGKILL all its processes (torchrun
    and every rank, at once) as soon as ``ready()`` is true, as a crash would; returns the exit
    status (negative: killed; 0: it finished before ``ready()`` held)."""
    proc = subprocess.Popen(trainer_command(address, args, nproc), env=trainer_env(), cwd=ROOT,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            if ready():
                kill_tree(proc.pid)
                break
            time.sleep(0.01)
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            kill_tree(proc.pid)
            proc.wait()
