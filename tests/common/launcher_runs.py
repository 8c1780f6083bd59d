"""``feeder run`` as a user runs it, for the launcher's tests: a process whose lines
are gathered as they come, one node's paths (socket, shm dir) with its processes
marked, and the checks that nothing of a run is left."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.proctree import kill_env, pids_with_env
from feeder.socket_claim import lock_path
from tests.common.env import ROOT, child_env

__all__ = ["N_TRAIN", "Run", "consumer", "node_of", "nothing_left", "serve_args"]

N_TRAIN = 4 * 24  # the train split of the shards the launcher's tests build

# Reads an epoch through FEEDER_ADDRESS (FEEDER_TOKEN, FEEDER_SHM_DIR), one batch per PAUSE_S,
# writing each batch's count to PROGRESS; prints its reconnects and what it saw; exits with STATUS.
_CONSUMER = r"""
import os, signal, sys, time
from collections import Counter
from pathlib import Path
from clients import FeederLoader
signal.signal(signal.SIGTERM, lambda *_: sys.exit(int(os.environ.get("ON_TERM", "143"))))
print("address", os.environ["FEEDER_ADDRESS"], "token", os.environ.get("FEEDER_TOKEN", "-"), flush=True)
print("shm dir", os.environ["FEEDER_SHM_DIR"], flush=True)
pause, progress = float(os.environ.get("PAUSE_S", "0")), Path(os.environ["PROGRESS"])
seen = Counter()
with FeederLoader(dataset="sample", batch_size=4, image_size=32, rank=0, world_size=1, return_keys=True,
                  reconnect_timeout_s=60) as loader:
    for _, _, keys in loader:
        seen.update(keys)
        progress.write_text(str(sum(seen.values())))
        time.sleep(pause)
    print("reconnects", loader.reconnects, flush=True)
    print("samples", sum(seen.values()), "most", max(seen.values()), loader.transport, flush=True)
time.sleep(float(os.environ.get("LINGER_S", "0")))
sys.exit(int(os.environ.get("STATUS", "0")))
"""


class Run:
    """A ``feeder run`` process, its lines (stdout: the command's; stderr: the
    launcher's and its daemon's) gathered as they come."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.out: list[str] = []
        self.err: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "feeder", "run", *args], cwd=ROOT, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        self._readers = [threading.Thread(target=self._gather, args=(stream, lines), daemon=True)
                         for stream, lines in ((self.proc.stdout, self.out), (self.proc.stderr, self.err))]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _gather(stream, lines: list[str]) -> None:
        for line in stream:
            lines.append(line.rstrip("\n"))

    def said(self, text: str) -> list[str]:
        return [line for line in list(self.err) if text in line]

    def reconnects(self) -> int:
        """How often the command's loader reconnected (its line, once it has read its epoch)."""
        return next(int(line.split()[1]) for line in self.out if line.startswith("reconnects "))

    def daemon_pids(self) -> list[int]:
        return [int(line.split("(pid ")[1].split(")")[0]) for line in self.said("feeder run: daemon serving on")]

    def wait(self, timeout_s: float = 120) -> int:
        code = self.proc.wait(timeout_s)
        for reader in self._readers:
            reader.join(10)  # every line read
        return code


@contextmanager
def node_of(tmp_path: Path, shards: Path) -> Iterator[dict]:
    """Paths of one node (socket, shm dir, progress file), and its processes marked
    (whatever of them is left is killed, and fails the test)."""
    shm = tmp_path / "shm"
    shm.mkdir()
    mark = uuid.uuid4().hex
    progress = tmp_path / "progress"
    found = {"shards": shards, "shm": shm, "socket": tmp_path / "feeder.sock", "progress": progress, "mark": mark,
             "env": child_env(FEEDER_TEST_RUN=mark, PROGRESS=str(progress))}
    for name in ("FEEDER_ADDRESS", "FEEDER_TOKEN", "FEEDER_SHM_DIR"):
        found["env"].pop(name, None)
    yield found
    left = pids_with_env("FEEDER_TEST_RUN", mark)
    kill_env("FEEDER_TEST_RUN", mark)
    assert not left, f"processes left behind: {left}"


def serve_args(node: dict, *more: str) -> list[str]:
    return ["--dataset", f"sample={node['shards']}", "--device", "cpu", "--threads", "1", "--port", "0",
            "--socket-path", str(node["socket"]), "--shm-dir", str(node["shm"]), "--grace-s", "1", *more]


def consumer(tmp_path: Path) -> list[str]:
    script = tmp_path / "consume.py"
    script.write_text(_CONSUMER)
    return [sys.executable, str(script)]


def nothing_left(node: dict) -> None:
    assert not pids_with_env("FEEDER_TEST_RUN", node["mark"])
    assert not list(node["shm"].iterdir())  # no segment
    assert not node["socket"].exists()
    assert not lock_path(node["socket"]).exists()
