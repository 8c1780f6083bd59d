"""One ``feeder shard`` run into an OUT at a time: a second is refused at once naming
the first's pid, with or without ``--overwrite``, and the first completes; the lock
a killed run leaves (its forked workers still alive) is taken over silently; no
trace of the lock is left in a finished OUT."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import suppress
from pathlib import Path

import pytest

from core.errors import ConfigError, NotFound
from sharder import ShardConfig, shard
from sharder.out_lock import LOCK_NAME, OutLock
from tests.common.waiting import wait_for
from tests.sharder.runs import REPO, SHARD_BYTES, killing_command, shard_command, tree_bytes

# A run that stops after its first shard until a line comes on stdin.
_PAUSE_AFTER_FIRST_SHARD = """
import sys
from sharder import ShardConfig, shard

def pause(split, number):
    if (split, number) == ("train", 0):
        print("paused", flush=True)
        sys.stdin.readline()

print(shard(ShardConfig(sys.argv[1], sys.argv[2], formats=("wds", "lmdb"), seed=7,
                        shard_size_bytes=int(sys.argv[3]), workers=2, on_shard_done=pause)).summary())
"""


# A process that takes OUT's lock, forks a child that outlives it, and is killed.
_KILLED_WITH_A_CHILD_ALIVE = """
import multiprocessing, os, signal, sys, time
from sharder.out_lock import OutLock

with OutLock(sys.argv[1]):
    child = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))
    child.start()
    print(child.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


def _takes(out: Path) -> bool:
    try:
        with OutLock(out):
            return True
    except ConfigError:
        return False


@pytest.mark.parametrize("extra", [(), ("--overwrite",)], ids=["plain", "overwrite"])
def test_a_second_run_is_refused_naming_the_first_which_completes(src: Path, reference: Path, tmp_path: Path,
                                                                  extra: tuple[str, ...]) -> None:
    out = tmp_path / "out"
    command = [sys.executable, "-c", _PAUSE_AFTER_FIRST_SHARD, str(src), str(out), str(SHARD_BYTES)]
    first = subprocess.Popen(command, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
    try:
        assert first.stdout is not None and first.stdin is not None
        assert first.stdout.readline() == "paused\n"
        owner = json.loads((out / LOCK_NAME).read_text())
        assert owner["pid"] == first.pid

        second = shard_command(src, out, *extra)

        assert second.returncode == 1, second.stderr
        pattern = (rf"feeder: error: OUT {re.escape(str(out))} is being sharded by pid {first.pid} "
                   r"\(started [0-9: -]+\)\n")
        assert re.fullmatch(pattern, second.stderr), second.stderr
        printed, err = first.communicate("\n", timeout=300)  # go on
        assert first.returncode == 0, err
        assert printed.startswith("sharded 42 images")
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert tree_bytes(out) == tree_bytes(reference)  # the first run's output, whole; no lock file


@pytest.mark.slow
def test_the_lock_of_a_killed_run_is_taken_over_silently(src: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    # Its own process group, so that the workers it forked, which outlive it, can be ended.
    killed = subprocess.Popen(killing_command(src, out, workers=2), cwd=REPO, stderr=subprocess.PIPE,
                              start_new_session=True)
    try:
        _, err = killed.communicate(timeout=300)
        assert killed.returncode == -signal.SIGKILL, err
        assert json.loads((out / LOCK_NAME).read_text())["pid"] == killed.pid  # left behind

        resumed = shard_command(src, out)

        assert resumed.returncode == 0 and resumed.stderr == "", resumed.stderr
    finally:
        with suppress(ProcessLookupError):
            os.killpg(killed.pid, signal.SIGKILL)
    assert not (out / LOCK_NAME).exists()
    assert tree_bytes(out) == tree_bytes(reference)


def test_a_forked_child_outliving_a_killed_run_does_not_keep_its_lock(tmp_path: Path) -> None:
    out = tmp_path / "out"
    killed = subprocess.Popen([sys.executable, "-c", _KILLED_WITH_A_CHILD_ALIVE, str(out)], cwd=REPO,
                              stdout=subprocess.PIPE, text=True)
    assert killed.stdout is not None
    child = int(killed.stdout.readline())  # the child keeps the pipe open: no waiting for its end
    killed.stdout.close()
    try:
        assert killed.wait(timeout=60) == -signal.SIGKILL
        os.kill(child, 0)  # still alive, and it was forked while the lock was held
        # The child lets go in its fork hook, which a loaded machine may not have run
        # by the time its parent is killed: taken within a few seconds, then.
        assert wait_for(lambda: _takes(out), timeout_s=10)
        os.kill(child, 0)
        with OutLock(out):
            assert json.loads((out / LOCK_NAME).read_text())["pid"] == os.getpid()
    finally:
        os.kill(child, signal.SIGKILL)


def test_one_process_cannot_take_a_lock_twice_and_a_new_out_is_removed_again(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    with OutLock(out):
        assert (out / LOCK_NAME).is_file()
        with pytest.raises(ConfigError, match=rf"is being sharded by pid {os.getpid()} \(started "):
            OutLock(out).__enter__()
    assert not (tmp_path / "new").exists()  # nothing was written into it


def test_a_failed_run_leaves_no_out_behind(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        shard(ShardConfig(tmp_path / "nowhere", tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_an_out_holding_only_a_stale_lock_is_empty(src: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_NAME).write_text('{"pid": 1, "host": "elsewhere", "started": "then"}\n')
    shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=7, shard_size_bytes=SHARD_BYTES))
    assert tree_bytes(out) == tree_bytes(reference)
