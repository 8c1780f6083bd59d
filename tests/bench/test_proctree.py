"""CPU and memory of a process tree, children included; what a run left behind."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from bench.proctree import cpu_seconds, kill_env, main, memory_bytes, pids_with_env, tree_pids


def test_a_busy_child_is_counted_in_its_parents_tree() -> None:
    busy_loop = "import time\nend = time.time() + 30\nwhile time.time() < end: pass"
    child = subprocess.Popen([sys.executable, "-c", busy_loop])
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


def test_what_a_run_left_behind_is_found_by_its_environment_whatever_its_session() -> None:
    mark = f"test-{os.getpid()}-{time.monotonic_ns()}"
    env = {**os.environ, "FEEDER_TEST_RUN": mark}
    # A child in a session of its own (as bench/throughput.py starts its workers), and its child.
    leader = subprocess.Popen([sys.executable, "-c", "import subprocess, sys, time\n"
                               "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
                               "time.sleep(60)"], env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 20
        while len(pids_with_env("FEEDER_TEST_RUN", mark)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        found = pids_with_env("FEEDER_TEST_RUN", mark)
        assert leader.pid in found and len(found) == 2
        assert pids_with_env("FEEDER_TEST_RUN", mark + "-other") == []
        assert sorted(kill_env("FEEDER_TEST_RUN", mark)) == found
        leader.wait(10)
        deadline = time.monotonic() + 10
        while pids_with_env("FEEDER_TEST_RUN", mark) and time.monotonic() < deadline:
            time.sleep(0.05)  # the grandchild, reparented, is reaped by init
        assert pids_with_env("FEEDER_TEST_RUN", mark) == []
    finally:
        if leader.poll() is None:
            leader.kill()
        kill_env("FEEDER_TEST_RUN", mark)


def test_the_command_line_kills_and_says_what_it_killed(capsys) -> None:
    assert main(["--kill", "FEEDER_TEST_RUN=nothing-started-with-this"]) == 0
    assert capsys.readouterr().out == ""
