"""A ``FeederLoader`` dropped without ``close()`` gives back what it holds: its stream
thread, its channel and the daemon's stream, when it is garbage-collected and when
the interpreter exits."""

from __future__ import annotations

import gc
import subprocess
import sys
import textwrap
import threading
import time
import warnings
import weakref
from pathlib import Path

import pytest

from clients import FeederLoader
from tests.common.env import ROOT, child_env
from tests.common.sample_daemon import start_daemon
from tests.common.waiting import wait_for

DROPPED = 4


def _stream_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "feeder-stream" and t.is_alive()]



def _take_one_batch(address: str) -> weakref.ref[FeederLoader]:
    loader = FeederLoader(address=address, dataset="sample", batch_size=4, image_size=32, rank=0,
                          world_size=1, prefetch_batches=2)
    next(iter(loader))
    return weakref.ref(loader)


@pytest.mark.slow
def test_dropped_loaders_end_their_threads_and_daemon_streams(shards: Path) -> None:
    server, port = start_daemon(shards)
    try:
        refs = [_take_one_batch(f"127.0.0.1:{port}") for _ in range(DROPPED)]
        gc.collect()
        assert all(ref() is None for ref in refs), "a dropped loader is still referenced"
        assert wait_for(timeout_s=10, predicate=lambda: not _stream_threads()), _stream_threads()
        assert wait_for(timeout_s=10, predicate=lambda: server.service.open_streams() == 0)
    finally:
        server.stop(0).wait(10)


def test_close_is_prompt_and_idempotent(shards: Path) -> None:
    server, port = start_daemon(shards)
    before = _stream_threads()
    try:
        loader = FeederLoader(address=f"127.0.0.1:{port}", dataset="sample", batch_size=4,
                              image_size=32, rank=0, world_size=1)
        next(iter(loader))
        stream = next(t for t in _stream_threads() if t not in before)
        with warnings.catch_warnings(record=True) as warned:
            warnings.simplefilter("always")
            loader.close()
            loader.close()
        # Prompt: the stream's thread ended when close() returned, without close() waiting
        # out its timeout (it warns when it leaves a thread behind).
        assert not stream.is_alive() and not [w for w in warned if "did not stop" in str(w.message)]
        assert wait_for(timeout_s=10, predicate=lambda: server.service.open_streams() == 0)
    finally:
        server.stop(0).wait(10)


_SCRIPT = textwrap.dedent("""
    import atexit, sys, threading, time

    def report():
        alive = [t for t in threading.enumerate() if t.name == "feeder-stream"]
        print("stream threads at exit:", len(alive), flush=True)

    atexit.register(report)  # first in, so it runs after the loader's own exit hook
    from clients import FeederLoader
    loader = FeederLoader(address=sys.argv[1], dataset="sample", batch_size=4, image_size=32,
                          rank=0, world_size=1, prefetch_batches=2)
    next(iter(loader))
    print("took a batch at", time.monotonic(), flush=True)  # exits holding the loader
""")


@pytest.mark.slow
def test_process_exits_promptly_without_close(shards: Path) -> None:
    server, port = start_daemon(shards)
    try:
        done = subprocess.run([sys.executable, "-c", _SCRIPT, f"127.0.0.1:{port}"], check=False, cwd=ROOT,
                              env={"PYTHONPATH": child_env()["PYTHONPATH"], "OMP_NUM_THREADS": "1"},
                              capture_output=True, text=True, timeout=120)
        exited = time.monotonic()
        assert done.returncode == 0, done.stderr
        assert "Traceback" not in done.stderr and "Fatal" not in done.stderr, done.stderr
        lines = done.stdout.splitlines()
        assert lines[-1] == "stream threads at exit: 0", done.stdout
        assert exited - float(lines[-2].split()[-1]) < 5, "exit waited on the stream"
        assert wait_for(timeout_s=10, predicate=lambda: server.service.open_streams() == 0)
    finally:
        server.stop(0).wait(10)
