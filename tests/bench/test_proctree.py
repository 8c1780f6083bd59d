"""CPU and memory of a process tree, children included."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.proctree import cpu_seconds, memory_bytes, tree_pids


def test_a_busy_child_is_counted_in_its_parents_tree() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 30\nwhile time.time() < end: pass"])
    try:
        before, deadline = cpu_seconds(os.getpid()), time.monotonic() + 20
        while cpu_seconds(os.getpid()) - before < 0.2 and time.monotonic() < deadline:
            time.sleep(0.1)  # this process sleeps: the CPU time is the child's
        assert cpu_seconds(os.getpid()) - before >= 0.2
        assert child.pid in tree_pids(os.getpid())
        assert memory_bytes(os.getpid()) > memory_bytes(child.pid) > 0
    finally:
        child.kill()
        child.wait()
