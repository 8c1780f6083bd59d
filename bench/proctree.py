"""CPU time and memory of a process and all its descendants, read from /proc; and the
processes a run left behind.

Loaders spread their work over worker processes, threads and (for feeder) a daemon;
counting the whole tree under the loader's process charges every loader for all the
CPU and memory it uses. A process that left its tree (a new session, a parent that
died) still carries the environment it was started with: a variable set for one run
finds all of them (:func:`pids_with_env`; ``python -m bench.proctree --kill NAME=VALUE``
kills them).
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

__all__ = ["cpu_seconds", "kill_env", "main", "memory_bytes", "pids_with_env", "tree_pids"]

_PROC = Path("/proc")
_TICKS_PER_S = os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:  # the process exited between listing and reading
        return None
    # The command name (field 2) may contain spaces; fields after it are plain.
    return text[text.rindex(")") + 2 :].split()


def tree_pids(root: int) -> list[int]:
    """``root`` and every live descendant of it."""
    children: dict[int, list[int]] = {}
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            if fields is not None:
                children.setdefault(int(fields[1]), []).append(int(entry.name))
    pids, todo = [], [root]
    while todo:
        pid = todo.pop()
        pids.append(pid)
        todo.extend(children.get(pid, []))
    return pids


def cpu_seconds(root: int) -> float:
    """User + system CPU seconds used so far by the live processes of ``root``'s tree."""
    ticks = 0
    for pid in tree_pids(root):
        fields = _stat_fields(pid)
        if fields is not None:
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
    return ticks / _TICKS_PER_S


def _pss_bytes(pid: int) -> int:
    """Proportional set size: shared pages are split between the processes using them."""
    try:
        lines = (_PROC / str(pid) / "smaps_rollup").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith("Pss:"):
            return int(line.split()[1]) * 1024
    return 0


def memory_bytes(root: int) -> int:
    """Resident memory of ``root``'s tree, shared pages counted once (sum of PSS)."""
    return sum(_pss_bytes(pid) for pid in tree_pids(root))


def pids_with_env(name: str, value: str) -> list[int]:
    """Live processes (of this user: others' environments cannot be read) started
    with ``name=value`` in their environment, this one excepted."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in _PROC.iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environ = (entry / "environ").read_bytes()  # empty for a zombie
        except OSError:
            continue
        if wanted in environ.split(b"\0"):
            found.append(int(entry.name))
    return sorted(found)


def kill_env(name: str, value: str) -> list[int]:
    """SIGKILLs what :func:`pids_with_env` finds; returns their pids."""
    killed = []
    for pid in pids_with_env(name, value):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            continue
        killed.append(pid)
    return killed


def main(argv: list[str] | None = None) -> int:
    """``--kill NAME=VALUE``: kill the processes started with it, print what was
    killed; exit 0 (nothing was left) or 1 (something was)."""
    parser = argparse.ArgumentParser(description="Kill the processes a run left behind.")
    parser.add_argument("--kill", required=True, metavar="NAME=VALUE", help="the run's environment variable")
    args = parser.parse_args(argv)
    name, sep, value = args.kill.partition("=")
    if not name or not sep:
        parser.error(f"--kill: {args.kill!r} is not NAME=VALUE")
    killed = kill_env(name, value)
    if killed:
        print(f"killed {len(killed)} process(es) left behind: {' '.join(map(str, killed))}")
    return 1 if killed else 0


if __name__ == "__main__":
    sys.exit(main())
