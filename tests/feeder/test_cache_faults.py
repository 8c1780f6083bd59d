"""The node-local shard cache of a ``feeder serve`` process under faults, against a
real S3 server: the daemon killed with SIGKILL in the middle of a shard download
leaves nothing that the next daemon on the directory takes for a shard, and that one
serves every sample once with the local copy's pixels, while a third is refused
the directory with one line; on a disk that is full
(ENOSPC: a tmpfs of a few pages mounted over the cache directory, in a user
namespace of the daemon's own) the daemon warns once and serves on from ranged
reads, every sample once an epoch, and its local dataset meanwhile."""

from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import time
from collections import Counter
from pathlib import Path

import grpc
import pytest
from typer.testing import CliRunner, Result

from bench.seaweedfs import SeaweedFS
from cli.app import app
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree
from tests.feeder.conftest import request

pytestmark = pytest.mark.slow

# A tmpfs this size over the cache directory holds a shard or two of the sample data.
_FULL_DISK = "160k"


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, shards: Path) -> str:
    return upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'cache-faults')}/sample")


def _daemon(server: SeaweedFS, datasets: dict, cache: Path, *options: str, lines: list[str] | None = None
            ) -> DaemonProcess:
    options = ("--device", "cpu", "--threads", "1", "--cache-dir", str(cache), "--s3-endpoint", server.endpoint_url,
               *options)
    return DaemonProcess(datasets, options, echo=None if lines is None else lines.append, start_timeout_s=60,
                         stop_timeout_s=10)


def _started(server: SeaweedFS, daemon: DaemonProcess) -> grpc.Channel:
    with pointed_at(server):  # the daemon's credentials come from its environment
        daemon.start()
    return grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", -1)])


def _epoch(stub: feeder_pb2_grpc.FeederStub, dataset: str, split: str = "train") -> list:
    """One epoch of ``split`` as (key, image bytes), padding left out."""
    batches = stub.StreamBatches(request(dataset=dataset, split=split, batch_size=4, image_size=16, seed=3))
    return [(key, batch.images) for batch in batches for key, pad in zip(batch.keys, batch.padding) if not pad]


def _once_alike(there: list, here: list, keys: dict) -> None:
    """Every sample of the split once, in the order and with the pixels of ``here``."""
    assert Counter(key for key, _ in there) == Counter(keys.keys()) and there == here


def _whole(shards_dir: Path) -> bool:
    """Every file under a cache's shards/ holds the bytes its name (their sha256) says."""
    return all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name[:64] for p in shards_dir.iterdir())


def _partial_download(cache: Path, daemon: DaemonProcess, timeout_s: float = 60) -> Path | None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and daemon.pid and os.path.exists(f"/proc/{daemon.pid}"):
        partial = [p for p in (cache / "partial").glob("*.part") if p.stat().st_size > 0]
        if partial:
            return partial[0]
        time.sleep(0.02)
    return None


def test_a_daemon_killed_mid_download_leaves_nothing_half_written_in_use(
        s3_server: SeaweedFS, shards: Path, remote: str, index_rows: dict, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    first = _daemon(s3_server, {"remote": remote}, cache, "--cache-fetch-bytes-per-s", "20000")
    try:
        with _started(s3_server, first) as channel:
            next(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request(dataset="remote", batch_size=4)))
            partial = _partial_download(cache, first)
            assert partial is not None, "no download was under way"
            os.kill(first.pid, signal.SIGKILL)
            killed = first.stop()
    finally:
        first.stop()
    assert killed == -signal.SIGKILL  # not stopped by SIGTERM, which could have cleaned up
    assert partial.exists()  # the half-written download is still there...
    assert not (cache / "shards" / f"{partial.name[:64]}.tar").exists() and _whole(cache / "shards")

    second = _daemon(s3_server, {"remote": remote, "local": shards}, cache)  # the dead one's lock went with it
    try:
        with _started(s3_server, second) as channel:
            assert list((cache / "partial").iterdir()) == []  # ...and gone before anything is read
            stub = feeder_pb2_grpc.FeederStub(channel)
            local = _epoch(stub, "local")
            _once_alike(_epoch(stub, "remote"), local, index_rows["train"])  # the store and what was cached
            tars = len(list((shards / "train").glob("*.tar")))
            deadline = time.monotonic() + 60
            while stub.GetStats(feeder_pb2.StatsRequest()).shard_cache_shards < tars and time.monotonic() < deadline:
                time.sleep(0.05)
            _once_alike(_epoch(stub, "remote"), local, index_rows["train"])  # the cache
            stats = stub.GetStats(feeder_pb2.StatsRequest())
            third = _second_daemon_on(s3_server, cache, remote)
        assert stats.shard_cache_hits > 0 and stats.shard_cache_download_failures == 0
        assert third.exit_code == 1 and third.stderr.count("\n") == 1, third.output
        assert third.stderr.startswith(f"feeder: error: cache_dir {cache}: in use by another feeder daemon "
                                       f"(pid {second.pid}); give each daemon its own --cache-dir"), third.stderr
    finally:
        second.stop()
    assert _whole(cache / "shards")


def _second_daemon_on(server: SeaweedFS, cache: Path, remote: str) -> Result:
    """``feeder serve`` on a cache directory another daemon holds."""
    with pointed_at(server):
        return CliRunner().invoke(app, ["serve", "--port", "0", "--device", "cpu", "--dataset", f"x={remote}",
                                        "--cache-dir", str(cache), "--s3-endpoint", server.endpoint_url])


def _cannot_mount() -> str | None:
    """Why a tmpfs cannot be mounted in a user namespace here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, text=True, timeout=30, check=False)
    return None if probe.returncode == 0 else f"unshare -Urm cannot mount a tmpfs here: {probe.stderr.strip()}"


def test_on_a_full_disk_the_daemon_warns_once_and_serves_on(
        s3_server: SeaweedFS, shards: Path, remote: str, index_rows: dict, tmp_path: Path) -> None:
    reason = _cannot_mount()
    if reason is not None:
        pytest.skip(reason)
    cache, lines = tmp_path / "cache", []
    cache.mkdir()
    daemon = _daemon(s3_server, {"remote": remote, "local": shards}, cache, lines=lines)
    # The daemon alone sees the tmpfs over the cache directory (exec: the same process).
    daemon.command = ["unshare", "-Urm", "sh", "-c", f'mount -t tmpfs -o size={_FULL_DISK} tmpfs "$0" && exec "$@"',
                      str(cache), *daemon.command]
    try:
        with _started(s3_server, daemon) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            local = _epoch(stub, "local")
            for _ in range(2):
                _once_alike(_epoch(stub, "remote"), local, index_rows["train"])
                assert len(_epoch(stub, "local", "val")) == len(index_rows["val"])  # its other dataset meanwhile
            stats = stub.GetStats(feeder_pb2.StatsRequest())
    finally:
        daemon.stop()
    assert stats.shard_cache_download_failures >= 1 and stats.shard_cache_budget_bytes < 160_000
    assert stats.shard_cache_misses > 0 and stats.samples_failed == 0
    full = [line for line in lines if "is full" in line]
    assert len(full) == 1 and "No space left on device" in full[0] and str(cache) in full[0], lines
    assert not [line for line in lines if "WARNING" in line and line not in full]  # no other warning
