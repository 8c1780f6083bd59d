"""A CUDA IPC ring's holder file, without CUDA: the daemon gives a ring back only once
no client holds it (a client killed lets go with its process), a client that comes
after that does not open it, and torch's counter is given back on the client's behalf."""

from __future__ import annotations

import fcntl
import gc
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from tests.common.env import child_env
from transport.base import TransportUnavailable
from transport.cuda_ipc import hold_while_alive
from transport.ring_holder import RingHolder, RingRetired, counter_value, give_back_share, hold_ring, holder_path
from transport.shm import sweep_stale

STREAM = "feeder-123-0a1b2c3d-7"
ROOT = Path(__file__).resolve().parents[2]

_CLIENT = """
import sys, time
from pathlib import Path
from transport.ring_holder import hold_ring
fd = hold_ring(Path(sys.argv[1]))
print("holding", flush=True)
time.sleep(600)
"""


def test_a_ring_nobody_holds_is_retired_and_its_file_goes(shm_dir: Path) -> None:
    path = holder_path(shm_dir, STREAM)
    holder = RingHolder(path)
    assert path.name == f"{STREAM}.cuda" and oct(path.stat().st_mode & 0o777) == "0o600"
    assert holder.retire() and not path.exists()
    assert holder.retire()  # idempotent


def test_a_held_ring_stays_until_its_client_lets_go(shm_dir: Path) -> None:
    holder = RingHolder(holder_path(shm_dir, STREAM))
    fd = hold_ring(holder.path)
    assert not holder.retire() and holder.path.exists()
    os.close(fd)
    assert holder.retire()


def test_a_client_after_the_ring_was_given_back_does_not_open_it(shm_dir: Path) -> None:
    holder = RingHolder(holder_path(shm_dir, STREAM))
    assert holder.retire()
    with pytest.raises(RingRetired, match="given back before it was opened"):
        hold_ring(holder.path)


def test_a_client_waiting_while_the_daemon_retires_finds_it_unlinked(shm_dir: Path) -> None:
    path = holder_path(shm_dir, STREAM)
    RingHolder(path)
    retiring = os.open(path, os.O_RDONLY)  # what the daemon holds while it retires the ring
    fcntl.flock(retiring, fcntl.LOCK_EX)
    raised: list[BaseException] = []

    def client() -> None:
        try:
            hold_ring(path)
        except BaseException as e:  # noqa: BLE001 - checked below
            raised.append(e)

    thread = threading.Thread(target=client)
    thread.start()
    thread.join(0.3)
    assert thread.is_alive()  # waits for the daemon's exclusive lock
    os.unlink(path)
    os.close(retiring)
    thread.join(10)
    assert len(raised) == 1 and isinstance(raised[0], RingRetired)


@pytest.mark.slow
def test_a_killed_client_lets_go_of_the_ring(shm_dir: Path) -> None:
    holder = RingHolder(holder_path(shm_dir, STREAM))
    client = subprocess.Popen([sys.executable, "-c", _CLIENT, str(holder.path)], cwd=ROOT, env=child_env(),
                              stdout=subprocess.PIPE, text=True)
    try:
        assert client.stdout is not None and client.stdout.readline().strip() == "holding"
        assert not holder.retire()
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    finally:
        if client.poll() is None:
            client.kill()
    assert holder.retire()


def test_holder_names_are_the_daemons_only(shm_dir: Path) -> None:
    for bad in ("../etc/passwd", "feeder-1-zz-1", ""):
        with pytest.raises(TransportUnavailable, match="stream id"):
            holder_path(shm_dir, bad)


def test_a_holder_file_of_a_dead_daemon_is_swept(shm_dir: Path) -> None:
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    stale = shm_dir / f"feeder-{dead.stdout.strip()}-0a1b2c3d-3.cuda"
    stale.touch()
    alive = RingHolder(holder_path(shm_dir, f"feeder-{os.getpid()}-0a1b2c3d-4"))
    assert sweep_stale(shm_dir) == [stale.name]
    assert alive.path.exists() and alive.retire()


def _torch_counters() -> tuple[torch.Tensor, bytes]:
    """A file of IPC counters as torch makes them: the same allocator (a 64-byte header,
    then 8-byte counters) as a CPU storage shared by file name, which stands in for it."""
    counters = torch.zeros(10_000, dtype=torch.int64)
    _, handle, _ = counters.untyped_storage()._share_filename_cpu_()
    return counters, handle


@pytest.mark.slow
def test_the_consumers_share_of_torchs_counter_is_given_back() -> None:
    counters, handle = _torch_counters()
    counters[7] = 1  # one consumer holds the block
    assert counter_value(handle, 7) == 1  # read where torch's own release writes
    assert give_back_share(handle, 7)
    assert counters[7] == 0 and counters.sum() == 0
    assert counter_value(b"/torch_no_such_counter_file", 7) is None
    assert not give_back_share(b"/torch_no_such_counter_file", 7)  # the producer's file is gone: nothing to do


def test_a_share_given_back_already_is_not_given_back_again() -> None:
    # torch's counter is unsigned: a second decrement would make it 2**64 - 1, and
    # the producer would keep the block in limbo for good.
    counters, handle = _torch_counters()
    counters[3] = 1
    torch.UntypedStorage._release_ipc_counter_cuda(handle, 3)  # what a consumer storage's deleter does
    assert counter_value(handle, 3) == 0
    assert not give_back_share(handle, 3)
    assert counters[3] == 0 and counter_value(handle, 3) == 0
    torch.UntypedStorage._release_ipc_counter_cuda(handle, 3)  # the double decrement this prevents
    assert counter_value(handle, 3) == 2**64 - 1


def test_counter_values_out_of_the_file_are_none() -> None:
    _, handle = _torch_counters()
    assert counter_value(handle, 10_000) is None and counter_value(handle, -1) is None
    assert counter_value(b"/../etc/passwd", 0) is None and counter_value(b"", 0) is None


@pytest.mark.slow
def test_the_lock_goes_with_the_last_view_of_the_ring(shm_dir: Path) -> None:
    holder = RingHolder(holder_path(shm_dir, STREAM))
    storage = torch.UntypedStorage(64)
    hold_while_alive(storage, hold_ring(holder.path), device=None)
    ring = torch.empty(0, dtype=torch.uint8).set_(storage)
    batch = ring[16:40].view(2, 4, 1, 3)
    del storage, ring
    gc.collect()
    assert not holder.retire()  # a batch of it is still referenced
    del batch
    gc.collect()
    assert holder.retire()
