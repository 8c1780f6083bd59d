"""A loader's worker process run watched by the bench: its own process group, a time
limit, its tree's memory peaks sampled while it runs, and killed with its tree
whatever way the bench ends (:func:`watched`, :func:`stop_workers`)."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from pathlib import Path

from bench.proctree import memory_bytes, tree_pids
from core.processes import limited

__all__ = ["NO_MEMORY", "REPO", "stop_workers", "watched"]

REPO = Path(__file__).resolve().parent.parent
# How often the parent samples a loader's resident memory (seconds; /proc/PID/statm,
# cheap) and, more rarely, its proportional set size (/proc/PID/smaps_rollup walks every
# page of the process: about 9 ms for a process that imported torch, taken from the
# CPUs the loaders run on; every 0.25 s that came to about 9 % of 2 CPUs for a daemon
# with 4 clients, 5 processes, and 2 % for inprocess).
_MEMORY_PERIOD_S = 0.25
_PSS_PERIOD_S = 2.0


class _MemoryWatch(threading.Thread):
    """Samples the memory of a process tree until stopped; keeps the peaks."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.peak_pss, self.peak_rss = pid, 0, 0
        self._stop_event = threading.Event()

    def run(self) -> None:
        """RSS every ``_MEMORY_PERIOD_S``; PSS every ``_PSS_PERIOD_S`` and whenever the
        RSS passes its peak by 1 % (so the PSS peak follows the RSS one)."""
        last_pss = float("-inf")
        while not self._stop_event.wait(_MEMORY_PERIOD_S):
            rss = sum(_rss_bytes(p) for p in tree_pids(self.pid))
            now = time.monotonic()
            if rss > self.peak_rss * 1.01 or now - last_pss >= _PSS_PERIOD_S:
                self.peak_pss = max(self.peak_pss, memory_bytes(self.pid))
                last_pss = now
            self.peak_rss = max(self.peak_rss, rss)

    def stop(self) -> dict[str, int]:
        self._stop_event.set()
        self.join()
        return {"peak_pss_bytes": self.peak_pss, "peak_rss_bytes": self.peak_rss}


def _rss_bytes(pid: int) -> int:
    try:
        return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, IndexError, ValueError):
        return 0


def _kill_tree(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the worker leads its own process group
    except ProcessLookupError:
        pass


NO_MEMORY = {"peak_pss_bytes": 0, "peak_rss_bytes": 0}

# Workers running now. Each leads a session of its own (so its tree can be killed as a
# whole without this process), so a signal to this process's group (a timeout's)
# does not reach them: they go with this process, however it ends.
# A worker killed with this process (die_with_parent) takes its daemon along (the daemon's
# own die_with_parent).
_RUNNING: set[subprocess.Popen] = set()


def stop_workers(signum: int, frame: object) -> None:
    """SIGTERM/SIGINT: kill the running workers' trees (their daemons too), then exit."""
    for proc in list(_RUNNING):
        _kill_tree(proc)
    raise SystemExit(128 + signum)


def watched(command: list[str], log: Path, limit_s: float) -> tuple[int, dict[str, int]]:
    """Runs ``command`` (leading a process group of its own) until it ends or ``limit_s``
    passes, its output in ``log``; returns its exit status and its tree's memory peaks.

    Raises:
        OSError: the command cannot be started.
    """
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    with open(log, "w") as log_file:
        proc = subprocess.Popen(limited(command, die_with_parent=True), cwd=REPO, env=env, stdout=log_file,
                                stderr=subprocess.STDOUT, start_new_session=True)
        _RUNNING.add(proc)
        watch = _MemoryWatch(proc.pid)
        watch.start()
        try:
            proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            _kill_tree(proc)
            proc.wait()
        finally:
            memory = watch.stop()
            _kill_tree(proc)  # leftovers (a daemon whose parent died) go with the group
            _RUNNING.discard(proc)
    return proc.returncode, memory
