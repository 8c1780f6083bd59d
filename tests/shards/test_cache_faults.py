"""The node-local shard cache under faults, in a process of its own that reads a
remote split through it (a real S3 server): killed with SIGKILL in the middle of a
shard download, it leaves nothing that the next user of the directory takes for a
shard; on a disk that is full (ENOSPC: a tmpfs of a few pages mounted over the
cache directory, in a user namespace) it warns once and its reads go on."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from bench.seaweedfs import SeaweedFS
from shards.ranged import RemoteAccess
from shards.reader import ShardDataset
from shards.shard_cache import ShardCache
from shards.store import StoreCounters, StoreOptions
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree
from tests.common.shards import build_sample_shards

REPO = Path(__file__).resolve().parents[2]

# Reads every train sample EPOCHS times, 4 at a time, through a cache at CACHE
# (downloads at RATE bytes/s); prints the cache's counters; with HOLD, then waits.
_READER = """
import json, logging, sys, time
from pathlib import Path
import numpy as np
from shards.ranged import RemoteAccess
from shards.reader import ShardDataset
from shards.shard_cache import ShardCache
from shards.store import StoreCounters, StoreOptions

logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
url, endpoint, directory, rate, epochs, hold = sys.argv[1:7]
cache = ShardCache(Path(directory), 1 << 30, fetch_bytes_per_s=int(rate))
access = RemoteAccess(StoreOptions(endpoint_url=endpoint), StoreCounters(), cache)
split = ShardDataset.open("remote", url, remote=access).splits["train"]
for _ in range(int(epochs)):
    for start in range(0, len(split), 4):
        split.read_many(np.arange(start, min(start + 4, len(split))))
    cache.settle(60)
print(json.dumps(cache.usage()._asdict()), flush=True)
if hold == "1":
    time.sleep(600)
cache.close()
"""


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("cache-faults"))


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, local: Path) -> str:
    return upload_tree(s3_server, local, f"s3://{fresh_bucket(s3_server, 'faults')}/sample")


def _reader(server: SeaweedFS, url: str, cache: Path, rate: int, epochs: int, hold: bool) -> list[str]:
    return [sys.executable, "-c", _READER, url, server.endpoint_url, str(cache), str(rate), str(epochs), str(int(hold))]


def _whole(shards_dir: Path) -> bool:
    """Every file under a cache's shards/ holds the bytes its name (their sha256) says."""
    return all(hashlib.sha256(p.read_bytes()).hexdigest() == p.name[:64] for p in shards_dir.iterdir())


def test_killed_mid_download_it_leaves_nothing_half_written_in_use(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    with pointed_at(s3_server):
        reader = subprocess.Popen(_reader(s3_server, remote, cache, 20_000, 1, True), cwd=REPO,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline, partial = time.monotonic() + 60, []
        while not partial and time.monotonic() < deadline and reader.poll() is None:
            partial = [p for p in (cache / "partial").glob("*.part") if p.stat().st_size > 0]
            time.sleep(0.02)
        assert partial, "no download was under way"
        os.kill(reader.pid, signal.SIGKILL)
    finally:
        reader.kill()
        reader.wait()
    assert partial[0].exists()  # the half-written download is still there...
    assert not (cache / "shards" / f"{partial[0].name[:64]}.tar").exists() and _whole(cache / "shards")

    again = ShardCache(cache, 1 << 30)  # the kernel released the dead reader's lock
    try:
        assert list((cache / "partial").iterdir()) == []  # ...and gone before anything is read
        with pointed_at(s3_server):
            split = ShardDataset.open("remote", remote, remote=RemoteAccess(
                StoreOptions(endpoint_url=s3_server.endpoint_url), StoreCounters(), again)).splits["train"]
        rows = np.arange(len(split))
        expected = ShardDataset.open("local", local).splits["train"].read_many(rows)
        for _ in range(2):  # from the store and what was cached, then from the cache
            assert all(np.array_equal(a, b) for a, b in zip(split.read_many(rows), expected))
            assert again.settle(30)
        assert again.usage().hits > 0
    finally:
        again.close()
    assert _whole(cache / "shards")


def _cannot_mount() -> str | None:
    """Why a tmpfs cannot be mounted in a user namespace here (None: it can)."""
    if shutil.which("unshare") is None:
        return "no unshare(1)"
    probe = subprocess.run(["unshare", "-Urm", "sh", "-c", "mount -t tmpfs -o size=64k tmpfs /tmp"],
                           capture_output=True, text=True, timeout=30)
    return None if probe.returncode == 0 else f"unshare -Urm cannot mount a tmpfs here: {probe.stderr.strip()}"


def test_on_a_full_disk_it_warns_once_and_reads_go_on(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    reason = _cannot_mount()
    if reason is not None:
        pytest.skip(reason)
    cache = tmp_path / "cache"
    cache.mkdir()
    # The reader alone sees a tmpfs of 160 KB over the cache directory: a shard or two fit.
    command = ["unshare", "-Urm", "sh", "-c", 'mount -t tmpfs -o size=160k tmpfs "$0" && exec "$@"', str(cache),
               *_reader(s3_server, remote, cache, 0, 3, False)]
    with pointed_at(s3_server):
        run = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-3000:]
    usage = json.loads(run.stdout.strip().splitlines()[-1])
    assert usage["download_failures"] >= 1 and usage["budget_bytes"] < 160_000
    samples = len(ShardDataset.open("local", local).splits["train"])
    assert usage["misses"] > 0 and usage["hits"] + usage["misses"] == 3 * samples  # every sample, each epoch
    full = [line for line in run.stderr.splitlines() if "is full" in line]
    assert len(full) == 1 and "No space left on device" in full[0] and str(cache) in full[0], run.stderr
    assert "WARNING" not in run.stderr.replace(full[0], "")  # no other warning
