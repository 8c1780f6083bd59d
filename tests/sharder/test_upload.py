"""``feeder shard SRC s3://bucket/prefix`` and ``feeder verify s3://...`` against a real
S3 server: the store ends up with the bytes a local run writes, the manifest last,
and a daemon serves it with the local copy's pixels, every sample once; a killed
run uploads only what is missing; a prefix holding a dataset is refused without
``--overwrite``; verify checks the store's copy and names URLs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.seaweedfs import SeaweedFS
from cli.app import app
from core.errors import ConfigError
from protos import feeder_pb2_grpc
from sharder import ShardConfig, shard_to_store
from sharder.verify import verify
from shards.index import read_index
from shards.layout import shard_name
from tests.common.s3 import fresh_bucket, pointed_at, store_of
from tests.feeder.conftest import connect, request, start

REPO = Path(__file__).resolve().parents[2]
SHARD_BYTES = 60_000


@pytest.fixture(scope="module")
def reference(wds_reference: Path) -> Path:
    """``src`` (tests/sharder/conftest.py) sharded locally with the options these uploads use."""
    return wds_reference


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _objects(server: SeaweedFS, url: str) -> dict[str, bytes]:
    store = store_of(server, url)
    return {name: bytes(store.get_range(name, 0, info.size)) if info.size else b""
            for name, info in sorted(store.listing().items())}


def _config(src: Path, url: str, stage: Path, **options) -> ShardConfig:
    return ShardConfig(src, url, seed=7, shard_size_bytes=SHARD_BYTES, stage_dir=stage, **options)


@pytest.mark.slow
def test_sharding_into_a_store_uploads_the_bytes_of_a_local_run(
        s3_server: SeaweedFS, src: Path, reference: Path, tmp_path: Path) -> None:
    url = f"s3://{fresh_bucket(s3_server)}/imagenet"
    with pointed_at(s3_server):
        result = CliRunner().invoke(app, ["shard", str(src), url, "--seed", "7", "--shard-size-bytes", "60000",
                                          "--stage-dir", str(tmp_path / "stage")])
    assert result.exit_code == 0, result.output
    assert result.stdout.strip().endswith(f"-> {url} (uploaded {len(_files(reference))} files, "
                                          f"{sum(map(len, _files(reference).values())) / 1e6:.1f} MB)")
    assert _objects(s3_server, url) == _files(reference)
    assert not (tmp_path / "stage").exists()
    with pointed_at(s3_server):
        checked = CliRunner().invoke(app, ["verify", url, "--full"])
    assert checked.exit_code == 0, checked.output
    assert checked.stdout.strip().endswith("images decoded: OK") and url in checked.stdout
    _served_alike(s3_server, url, reference)


def _served_alike(server: SeaweedFS, url: str, local: Path) -> None:
    """A daemon serving ``url`` gives every sample once, with the pixels of ``local``."""
    with pointed_at(server):
        daemon, port = start({"remote": url, "local": local}, s3_endpoint=server.endpoint_url)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            for split in ("train", "val"):
                fields = dict(split=split, batch_size=3, image_size=32, seed=1)  # 36 and 6 samples: no remainder
                there = [(tuple(b.keys), tuple(b.padding), b.images)
                         for b in stub.StreamBatches(request(dataset="remote", **fields))]
                here = [(tuple(b.keys), tuple(b.padding), b.images)
                        for b in stub.StreamBatches(request(dataset="local", **fields))]
                assert there == here
                keys = [k for batch_keys, pads, _ in there for k, p in zip(batch_keys, pads) if not p]
                assert len(keys) == len(set(keys)) == len(read_index(local, split))
    finally:
        daemon.stop(0).wait(10)


def test_the_manifest_is_uploaded_after_every_other_file(s3_server: SeaweedFS, src: Path, tmp_path: Path) -> None:
    url = f"s3://{fresh_bucket(s3_server)}/d"
    seen: list[set[str]] = []

    def look(split: str, number: int) -> None:
        """While the run goes on, the shard before this one reaches the store."""
        store, deadline = store_of(s3_server, url), time.monotonic() + 30
        while time.monotonic() < deadline:
            seen.append(set(store.listing()))
            if number == 0 or f"{split}/{shard_name(number - 1)}" in seen[-1]:
                return
            time.sleep(0.05)

    with pointed_at(s3_server):
        shard_to_store(_config(src, url, tmp_path / "stage", on_shard_done=look))
    assert len(seen) >= 3 and not any("manifest.json" in names for names in seen)
    assert "train/shard-000001.tar" in seen[-1]


# Killed at the second train shard, once the first is in the store (its upload runs
# beside the sharder: killed at once, a loaded machine had uploaded nothing, and the
# resumed run had nothing to leave out).
_KILL_AT_THE_SECOND_TRAIN_SHARD = """
import os, signal, sys, time
from pathlib import Path
from sharder import ShardConfig, shard_to_store
from shards.objects import ObjectUrl
from shards.store import ObjectStore, StoreOptions

def die(split, number):
    if split == "train" and number == 1:
        store, deadline = ObjectStore(ObjectUrl.parse(sys.argv[2]), StoreOptions()), time.monotonic() + 60
        while "train/shard-000000.tar" not in store.listing() and time.monotonic() < deadline:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)

shard_to_store(ShardConfig(sys.argv[1], sys.argv[2], seed=7, shard_size_bytes=int(sys.argv[3]),
                           stage_dir=Path(sys.argv[4]), on_shard_done=die))
"""


@pytest.mark.slow
def test_a_killed_run_resumes_and_uploads_only_what_is_missing(
        s3_server: SeaweedFS, src: Path, reference: Path, tmp_path: Path) -> None:
    url, stage = f"s3://{fresh_bucket(s3_server)}/killed", tmp_path / "stage"
    command = [sys.executable, "-c", _KILL_AT_THE_SECOND_TRAIN_SHARD, str(src), url, str(SHARD_BYTES), str(stage)]
    with pointed_at(s3_server):
        killed = subprocess.run(command, cwd=REPO, capture_output=True, timeout=120, env=dict(os.environ))
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    before = _objects(s3_server, url)
    assert "train/shard-000000.tar" in before and "manifest.json" not in before  # killed part-way
    expected = _files(reference)
    assert all(expected[name] == data for name, data in before.items())  # whatever is there is whole

    with pointed_at(s3_server):
        report = shard_to_store(_config(src, url, stage))

    assert report.uploaded_files == len(expected) - len(before)
    assert _objects(s3_server, url) == expected


def test_a_prefix_holding_a_dataset_is_refused_without_overwrite(
        s3_server: SeaweedFS, src: Path, reference: Path, tmp_path: Path) -> None:
    url = f"s3://{fresh_bucket(s3_server)}/taken"
    with pointed_at(s3_server):
        shard_to_store(_config(src, url, tmp_path / "a", max_side_px=64))
        with pytest.raises(ConfigError, match=rf"^OUT {url} holds a dataset \(use --overwrite to replace it\)"):
            shard_to_store(_config(src, url, tmp_path / "b"))
        store_of(s3_server, url).put_bytes("stray.bin", b"x")
        shard_to_store(_config(src, url, tmp_path / "c", overwrite=True))
    assert _objects(s3_server, url) == _files(reference)


def test_verify_names_a_damaged_remote_shard_by_its_url(
        s3_server: SeaweedFS, src: Path, reference: Path, tmp_path: Path) -> None:
    url = f"s3://{fresh_bucket(s3_server)}/damaged"
    with pointed_at(s3_server):
        shard_to_store(_config(src, url, tmp_path / "stage"))
    tar = "train/shard-000000.tar"
    data = bytearray((reference / tar).read_bytes())
    data[1024:1124] = bytes(100)
    store_of(s3_server, url).put_bytes(tar, bytes(data))
    with pointed_at(s3_server):
        result = verify(url, full=True)
    assert result.problems and all(p.startswith(f"{url}/{tar}: sha256 differs") for p in result.problems)


def test_verify_of_a_store_it_cannot_read_is_one_line(s3_server: SeaweedFS) -> None:
    with pointed_at(s3_server, AWS_SECRET_ACCESS_KEY="wrong"):
        result = CliRunner().invoke(app, ["verify", f"s3://{fresh_bucket(s3_server)}/x"])
    assert result.exit_code == 1
    assert result.stderr.strip().startswith("feeder: not authenticated: s3://") and len(result.stderr.splitlines()) == 1
