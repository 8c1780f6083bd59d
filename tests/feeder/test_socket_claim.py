"""One owner per unix socket: daemons starting at once on one path, a socket left by
a daemon killed outright, and the sweep that removes what such a daemon left."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from core.errors import ConfigError
from feeder.security import listen_on_socket
from feeder.socket_claim import SocketClaim, lock_path, sweep_socket

ROUNDS = 200


def _claim_race(path: Path) -> tuple[list[object], list[str]]:
    """Two threads claim ``path`` at the same moment, each for a server of its own;
    (what each that got it holds, the refusals' messages)."""
    owners: list[object] = []
    refusals: list[str] = []
    servers = [grpc.server(futures.ThreadPoolExecutor(max_workers=1)) for _ in range(2)]
    start = threading.Barrier(2)

    def claim(server: grpc.Server) -> None:
        start.wait()
        try:
            owners.append(listen_on_socket(server, path))
        except ConfigError as e:
            refusals.append(str(e))

    threads = [threading.Thread(target=claim, args=(server,)) for server in servers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return owners, refusals


def test_of_200_concurrent_claims_of_one_socket_none_ends_with_two_owners(tmp_path):
    path = tmp_path / "feeder.sock"
    two_owners, other_refusals = 0, []
    for _ in range(ROUNDS):
        owners, refusals = _claim_race(path)
        two_owners += len(owners) == 2
        other_refusals += [r for r in refusals if not r.startswith(f"socket_path: a daemon is serving on {path}")]
        for owner in owners:
            if isinstance(owner, SocketClaim):
                owner.release()
        if path.exists():  # where nothing released it: the next round starts clean all the same
            path.unlink()
    assert two_owners == 0, f"{two_owners} of {ROUNDS} rounds ended with both claims owning {path}"
    assert not other_refusals  # each round: one owner, the other told who serves there


def test_a_claim_is_refused_while_held_and_free_once_released(tmp_path):
    path = tmp_path / "feeder.sock"
    first = SocketClaim.take(path)
    assert first is not None and lock_path(path).exists()
    assert SocketClaim.take(path) is None  # another claim of this very process, too
    first.release()
    assert not lock_path(path).exists()
    again = SocketClaim.take(path)
    assert again is not None
    again.release()


_HOLDER = r"""
import sys, time
from pathlib import Path
from feeder.socket_claim import SocketClaim
claim = SocketClaim.take(Path(sys.argv[1]))
import socket
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
print("holding", flush=True)
time.sleep(600)
"""


def _holder(path: Path) -> subprocess.Popen[str]:
    holder = subprocess.Popen([sys.executable, "-c", _HOLDER, str(path)], stdout=subprocess.PIPE, text=True,
                              cwd=Path(__file__).resolve().parents[2])
    assert holder.stdout is not None and holder.stdout.readline().strip() == "holding"
    return holder


def test_what_a_killed_owner_left_is_swept_and_a_live_owners_socket_is_not(tmp_path):
    path = tmp_path / "feeder.sock"
    holder = _holder(path)
    try:
        assert not sweep_socket(path)  # its owner is alive
        assert path.exists() and lock_path(path).exists()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    assert holder.returncode == -signal.SIGKILL  # killed outright: nothing of its own was cleaned
    assert path.exists() and lock_path(path).exists()
    assert sweep_socket(path)
    assert not path.exists() and not lock_path(path).exists()


def test_a_socket_left_by_a_killed_owner_is_claimed_again(tmp_path):
    path = tmp_path / "feeder.sock"
    holder = _holder(path)
    os.kill(holder.pid, signal.SIGKILL)
    holder.wait()
    assert path.exists() and lock_path(path).exists()  # left as they were
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    claim = listen_on_socket(server, path)
    with socket.socket(socket.AF_UNIX) as probe:
        probe.connect(str(path))  # the new server's socket
    claim.release()
    assert not path.exists() and not lock_path(path).exists()


@pytest.mark.parametrize("kind", ["directory", "link"])
def test_a_lock_path_that_is_not_a_plain_file_is_one_line(tmp_path, kind):
    path = tmp_path / "feeder.sock"
    if kind == "directory":
        lock_path(path).mkdir()
    else:
        lock_path(path).symlink_to(tmp_path / "elsewhere")
    with pytest.raises(ConfigError, match=f"socket_path: cannot make its lock file {lock_path(path)}"):
        SocketClaim.take(path)
