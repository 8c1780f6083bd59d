"""Ending a process tree at once, as a crash would."""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["kill_tree"]


def kill_tree(root: int) -> None:
    """SIGKILL ``root`` and every process descended from it (torchrun starts its ranks
    in sessions of their own, so a process group does not reach them)."""
    parents: dict[int, int] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        parents[int(stat.parent.name)] = int(fields[1])
    tree, frontier = {root}, [root]
    while frontier:
        children = [pid for pid, parent in parents.items() if parent in frontier]
        tree.update(children)
        frontier = children
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
