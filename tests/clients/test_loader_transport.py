"""How pixels reach a FeederLoader: shared memory with a daemon on this host, the
gRPC payload otherwise; and nothing of either side left in /dev/shm whatever dies."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import grpc
import pytest

from clients import FeederLoader
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.env import ROOT, child_env
from tests.common.sample_daemon import N_TRAIN, start_daemon
from tests.common.waiting import wait_for
from transport.base import HostIdentity

SHM = Path("/dev/shm")


def _segments(pid: int, shm_dir: Path = SHM) -> list[str]:
    return sorted(p.name for p in shm_dir.glob(f"feeder-{pid}-*"))



def _epoch_keys(loader: FeederLoader) -> Counter[str]:
    return Counter(k for _, _, keys in loader for k in keys)


def _loader(address: str, **options) -> FeederLoader:
    base = dict(dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1, return_keys=True)
    return FeederLoader(address=address, **(base | options))


def test_a_local_loader_gets_shared_memory_and_every_sample_once(shards):
    server, port = start_daemon(shards)
    try:
        with _loader(f"127.0.0.1:{port}") as loader:
            assert loader.transport == ""
            seen = _epoch_keys(loader)
            assert loader.transport == "shm"
            assert _segments(os.getpid())  # the open stream's ring
            # Slots went back through their release words in the segment: no calls.
            assert loader._streams.pool.members[0].connection.releaser.calls == 0
        assert sum(seen.values()) == N_TRAIN and set(seen.values()) == {1}
        assert wait_for(timeout_s=5, predicate=lambda: not _segments(os.getpid()))  # unlinked when the stream ended
    finally:
        server.stop(0).wait(10)


def test_grpc_when_asked_and_when_the_client_is_on_another_host(shards, monkeypatch):
    server, port = start_daemon(shards)
    try:
        with _loader(f"127.0.0.1:{port}", transport="grpc") as loader:
            assert sum(_epoch_keys(loader).values()) == N_TRAIN
            assert loader.transport == "grpc"
        # A client that says it runs elsewhere (another kernel) asks for shm: refused,
        # it gets the pixels inline and loses nothing.
        elsewhere = HostIdentity(boot_id="another-machine", hostname="elsewhere", shm_device=1)
        monkeypatch.setattr(HostIdentity, "of_this_process", classmethod(lambda cls, shm_dir=SHM: elsewhere))
        with _loader(f"127.0.0.1:{port}", transport="shm") as loader:
            assert sum(_epoch_keys(loader).values()) == N_TRAIN
            assert loader.transport == "grpc"
    finally:
        server.stop(0).wait(10)


def test_a_full_dev_shm_falls_back_to_grpc(shards, monkeypatch, caplog):
    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    server, port = start_daemon(shards)
    try:
        with caplog.at_level(logging.WARNING, logger="transport.daemon"), _loader(f"127.0.0.1:{port}") as loader:
            assert sum(_epoch_keys(loader).values()) == N_TRAIN
            assert loader.transport == "grpc"
        # The daemon met the full /dev/shm (not some other reason to send inline).
        assert "shared memory full" in caplog.text, caplog.text
        assert not _segments(os.getpid())
    finally:
        server.stop(0).wait(10)


def test_a_stale_or_twice_released_slot_is_invalid_and_the_daemon_goes_on(shards):
    server, port = start_daemon(shards)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            request = feeder_pb2.StreamRequest(
                dataset="sample", split="train", world_size=1, batch_size=4, image_size=32,
                transport=feeder_pb2.TRANSPORT_SHM,
                client_host=HostIdentity.of_this_process().client_host().to_message())
            call = stub.StreamBatches(request)  # kept open: slots of ended streams are moot
            first = next(call)
            assert first.WhichOneof("pixels") == "shm" and first.shm.segment
            lent = first.shm.slot
            stub.ReleaseSlots(feeder_pb2.ReleaseRequest(slots=[lent]))
            for bad in (lent,  # released twice
                        feeder_pb2.SlotRef(stream_id=lent.stream_id, index=99, generation=1),
                        feeder_pb2.SlotRef(stream_id=lent.stream_id, index=lent.index,
                                           generation=lent.generation + 7)):
                with pytest.raises(grpc.RpcError) as caught:
                    stub.ReleaseSlots(feeder_pb2.ReleaseRequest(slots=[bad]))
                assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            call.cancel()
        with _loader(f"127.0.0.1:{port}") as loader:
            assert sum(_epoch_keys(loader).values()) == N_TRAIN
    finally:
        server.stop(0).wait(10)


_CLIENT = """
import sys, time
from clients import FeederLoader
loader = FeederLoader(address=sys.argv[1], dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1)
for i, _ in enumerate(loader):
    if i == 1:
        print("holding", flush=True)
        time.sleep(600)
"""


@pytest.mark.slow
def test_a_client_killed_mid_stream_frees_its_ring_and_others_go_on(shards):
    server, port = start_daemon(shards)
    address = f"127.0.0.1:{port}"
    try:
        env = child_env()
        client = subprocess.Popen([sys.executable, "-c", _CLIENT, address], env=env, stdout=subprocess.PIPE,
                                  text=True)
        try:
            assert client.stdout is not None and client.stdout.readline().strip() == "holding"
            assert _segments(os.getpid())
            with _loader(address) as other:  # another stream, meanwhile
                other_keys = _epoch_keys(other)
            client.send_signal(signal.SIGKILL)
            assert client.wait(10) == -signal.SIGKILL
        finally:
            if client.poll() is None:
                client.kill()
        assert sum(other_keys.values()) == N_TRAIN
        # The daemon notices the dead client (its call is cancelled) and unlinks the ring.
        assert wait_for(timeout_s=30,
                        predicate=lambda: not _segments(os.getpid()) and server.service.open_streams() == 0)
    finally:
        server.stop(0).wait(10)


@pytest.mark.slow
def test_a_daemon_killed_and_restarted_is_swept_and_the_loader_resumes_over_shm(shards, tmp_path):
    # A shm dir of its own: a daemon another test starts meanwhile sweeps /dev/shm, and
    # would take the killed daemon's segments before the restarted one could.
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    options = ("--device", "cpu", "--threads", "1", "--shm-dir", str(shm_dir))
    first = DaemonProcess({"sample": shards}, options, cwd=ROOT)
    first.start()
    port = first.address.rsplit(":", 1)[1]
    seen: Counter[str] = Counter()
    try:
        with _loader(first.address, batch_size=4, shm_dir=shm_dir, reconnect_timeout_s=60) as loader:
            batches = iter(loader)
            for _ in range(3):
                seen.update(next(batches)[2])
            assert loader.transport == "shm" and _segments(first.pid, shm_dir)
            os.kill(first.pid, signal.SIGKILL)
            first.stop()
            assert _segments(first.pid, shm_dir)  # a daemon killed with SIGKILL cannot clean up
            second = DaemonProcess({"sample": shards}, (*options, "--port", port), cwd=ROOT)
            second.command.remove("0")  # the same port as before, not a free one
            second.command.remove("--port")
            second.start()
            try:
                assert not _segments(first.pid, shm_dir)  # swept by the new daemon at start
                for batch in batches:
                    seen.update(batch[2])
                assert loader.transport == "shm" and loader.reconnects >= 1
            finally:
                second.stop()
        assert sum(seen.values()) == N_TRAIN and set(seen.values()) == {1}
        assert not _segments(second.pid, shm_dir)
    finally:
        first.stop()


def _in_new_pid_namespace(daemon: DaemonProcess) -> DaemonProcess:
    daemon.command[:0] = ["unshare", "--pid", "--fork", "--kill-child"]  # pid 1 in it, as in a container
    return daemon


def _stop_in_namespace(daemon: DaemonProcess) -> None:
    # SIGTERM to the daemon itself, as a container runtime sends it to pid 1 (unshare
    # would only pass its own death on as SIGKILL).
    if daemon.returncode is None:
        children = Path(f"/proc/{daemon.pid}/task/{daemon.pid}/children").read_text().split()
        for child in children:
            os.kill(int(child), signal.SIGTERM)
    daemon.stop()


@pytest.mark.slow
@pytest.mark.skipif(subprocess.run(["unshare", "--pid", "--fork", "true"], capture_output=True).returncode != 0,
                    reason="unshare --pid: no new pid namespaces here (needs root or user namespaces)")
def test_a_daemon_restarted_in_a_new_pid_namespace_reclaims_segments_whose_pid_is_alive(shards, tmp_path):
    # A container restart on a memory-backed /dev/shm: the killed daemon was pid 1 in its
    # namespace, the new one is pid 1 in another, so the number in the old segments'
    # names is a live process's (the host's init, the new daemon itself).
    shm_dir = tmp_path / "shm"
    shm_dir.mkdir()
    options = ("--device", "cpu", "--threads", "1", "--shm-dir", str(shm_dir))
    first = _in_new_pid_namespace(DaemonProcess({"sample": shards}, options, cwd=ROOT))
    first.start()
    port = first.address.rsplit(":", 1)[1]
    seen: Counter[str] = Counter()
    try:
        with _loader(first.address, batch_size=4, shm_dir=shm_dir, reconnect_timeout_s=60) as loader:
            batches = iter(loader)
            for _ in range(3):
                seen.update(next(batches)[2])
            left = sorted(p.name for p in shm_dir.iterdir())
            assert loader.transport == "shm" and left and all(name.startswith("feeder-1-") for name in left)
            first.kill()
            assert sorted(p.name for p in shm_dir.iterdir()) == left  # SIGKILL: nothing cleaned up
            second = _in_new_pid_namespace(DaemonProcess({"sample": shards}, (*options, "--port", port), cwd=ROOT))
            second.start()
            try:
                assert not set(left) & {p.name for p in shm_dir.iterdir()}  # every one reclaimed at start
                for batch in batches:
                    seen.update(batch[2])
                assert loader.transport == "shm" and loader.reconnects >= 1
            finally:
                _stop_in_namespace(second)
        assert sum(seen.values()) == N_TRAIN and set(seen.values()) == {1}
        assert not list(shm_dir.iterdir())
    finally:
        first.stop()
