"""Real ``feeder shard`` runs in child processes, for the tests of what happens to OUT
when a run is killed, runs out of room or meets another run: the command itself,
and a run killed with SIGKILL after its second shard."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from core.processes import limited

__all__ = [
    "OPTIONS", "REPO", "SHARD_BYTES", "kill_after_second_shard", "killing_command", "shard_command", "tree_bytes",
]

REPO = Path(__file__).resolve().parents[2]
SHARD_BYTES = 60_000  # four tars of the train split of the tree these tests shard
OPTIONS = ("--formats", "wds,lmdb", "--seed", "7", "--shard-size-bytes", str(SHARD_BYTES), "--no-progress")

_KILL_AFTER_SECOND_SHARD = """
import os, signal, sys
from sharder import ShardConfig, shard

def die(split, number):
    if number == 1:
        os.kill(os.getpid(), signal.SIGKILL)

shard(ShardConfig(sys.argv[1], sys.argv[2], formats=("wds", "lmdb"), seed=7,
                  shard_size_bytes=int(sys.argv[3]), workers=int(sys.argv[4]), on_shard_done=die))
"""


def tree_bytes(root: Path) -> dict[str, bytes]:
    """Every file under ``root`` (relative path -> bytes)."""
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def shard_command(src: Path, out: Path, *extra: str, file_size_bytes: int | None = None,
                  **popen: Any) -> subprocess.CompletedProcess[str]:
    """``python -m feeder shard SRC OUT`` with ``OPTIONS`` and ``extra``, run to its end
    (``file_size_bytes``: its RLIMIT_FSIZE; ``popen``: more arguments of
    ``subprocess.run``)."""
    command = limited([sys.executable, "-m", "feeder", "shard", str(src), str(out), *OPTIONS, *extra],
                      file_size_bytes=file_size_bytes)
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}  # nothing written but the run's own files
    return subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=300, **popen)


def killing_command(src: Path, out: Path, workers: int = 1) -> list[str]:
    """A run with the options of ``OPTIONS`` (and ``workers``) that kills itself with
    SIGKILL once its second shard is durable."""
    return [sys.executable, "-c", _KILL_AFTER_SECOND_SHARD, str(src), str(out), str(SHARD_BYTES), str(workers)]


def kill_after_second_shard(src: Path, out: Path) -> subprocess.CompletedProcess[bytes]:
    """:func:`killing_command` run to its end."""
    return subprocess.run(killing_command(src, out), cwd=REPO, capture_output=True, timeout=300)
