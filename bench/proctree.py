"""CPU time and memory of a process and all its descendants, read from /proc.

Loaders spread their work over worker processes, threads and (for feeder) a daemon;
counting the whole tree under the loader's process charges every loader for all the
CPU and memory it uses.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cpu_seconds", "memory_bytes", "tree_pids"]

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
