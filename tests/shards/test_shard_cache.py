"""The node-local shard cache under a remote split (a real S3 server): shards fetched
whole in the background and read locally afterwards, kept across restarts, within
its budget, never half-written, one daemon to a directory."""

from __future__ import annotations

import hashlib
import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest

from bench.seaweedfs import SeaweedFS
from core.errors import ConfigError
from shards.ranged import RemoteAccess
from shards.reader import ShardDataset, SplitIndex
from shards.shard_cache import CachedShard, ShardCache
from shards.store import StoreCounters, StoreOptions
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree
from tests.common.shards import build_sample_shards


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("cache-source"))


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, local: Path) -> str:
    return upload_tree(s3_server, local, f"s3://{fresh_bucket(s3_server, 'cache')}/shards")


def _split(
    server: SeaweedFS, url: str, cache: ShardCache | None, name: str = "val"
) -> tuple[SplitIndex, StoreCounters]:
    counters = StoreCounters()
    access = RemoteAccess(StoreOptions(endpoint_url=server.endpoint_url), counters, cache)
    with pointed_at(server):
        return ShardDataset.open("remote", url, remote=access).splits[name], counters


def _shard_bytes(local: Path, split: str = "val") -> list[int]:
    return sorted(p.stat().st_size for p in (local / split).glob("*.tar"))


def test_shards_are_fetched_once_and_read_locally_from_then_on(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    try:
        split, counters = _split(s3_server, remote, cache)
        expected = ShardDataset.open("local", local).splits["val"].read_many(np.arange(len(split)))
        first = split.read_many(np.arange(len(split)))  # ranged GETs; the shards are wanted meanwhile
        assert cache.settle(30)
        usage = cache.usage()
        assert (usage.misses, usage.hits, usage.downloads) == (len(split), 0, len(_shard_bytes(local)))
        requests = counters.snapshot()["requests"]
        again = split.read_many(np.arange(len(split)))
        assert counters.snapshot()["requests"] == requests and cache.usage().hits == len(split)
        assert all(np.array_equal(a, b) and np.array_equal(b, c) for a, b, c in zip(first, again, expected))
        manifest = json.loads((local / "manifest.json").read_text())
        named = {f"{s['sha256']}.tar" for s in manifest["splits"]["val"]["shards"]}
        assert {p.name for p in (tmp_path / "cache" / "shards").iterdir()} == named
    finally:
        cache.close()


def test_the_cache_survives_a_restart_and_is_checked_cheaply(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    directory = tmp_path / "cache"
    cache = ShardCache(directory, 1 << 30)
    split, _ = _split(s3_server, remote, cache, "train")
    split.read_many(np.arange(len(split)))
    assert cache.settle(30)
    cache.close()
    (directory / "partial" / f"{'0' * 64}.999.part").write_bytes(b"half of a shard")  # a daemon killed mid-download
    (directory / "shards" / "stray.tmp").write_bytes(b"not a shard")
    victim = sorted((directory / "shards").glob("*.tar"))[0]
    victim_size = victim.stat().st_size
    victim.write_bytes(victim.read_bytes()[:-1])  # not the size the manifest says

    again = ShardCache(directory, 1 << 30)
    try:
        assert list((directory / "partial").iterdir()) == [] and not (directory / "shards" / "stray.tmp").exists()
        split, _ = _split(s3_server, remote, again, "train")
        samples = split.read_many(np.arange(len(split)))
        expected = ShardDataset.open("local", local).splits["train"].read_many(np.arange(len(split)))
        assert all(np.array_equal(a, b) for a, b in zip(samples, expected))
        usage = again.usage()
        assert usage.hits > 0 and usage.misses > 0  # the short copy was not used
        assert not victim.exists() or victim.stat().st_size == victim_size
    finally:
        again.close()


def test_a_second_daemon_is_refused_the_directory_naming_the_first(tmp_path: Path) -> None:
    first = ShardCache(tmp_path / "cache", 1 << 20)
    try:
        with pytest.raises(ConfigError, match=rf"cache_dir {tmp_path / 'cache'}: in use by another feeder daemon "
                                              r"\(pid \d+\); give each daemon its own --cache-dir"):
            ShardCache(tmp_path / "cache", 1 << 20)
    finally:
        first.close()
    ShardCache(tmp_path / "cache", 1 << 20).close()  # free again once the first is gone


def test_a_budget_smaller_than_a_shard_means_ranged_reads_only(
        s3_server: SeaweedFS, remote: str, local: Path, tmp_path: Path) -> None:
    cache = ShardCache(tmp_path / "cache", min(_shard_bytes(local)) - 1)
    try:
        split, _ = _split(s3_server, remote, cache)
        split.read_many(np.arange(len(split)))
        assert cache.settle(10)
        assert cache.usage().downloads == 0 and list((tmp_path / "cache" / "shards").iterdir()) == []
    finally:
        cache.close()


def test_past_the_budget_the_least_recently_used_shard_goes(
        s3_server: SeaweedFS, remote: str, local: Path, tmp_path: Path) -> None:
    sizes = _shard_bytes(local, "train")
    budget = sizes[-1] + sizes[-2]  # any two train shards fit, never three
    cache = ShardCache(tmp_path / "cache", budget)
    try:
        split, _ = _split(s3_server, remote, cache, "train")
        for shard in sorted({split.shard_of(i) for i in range(len(split))}):
            split.read_many([i for i in range(len(split)) if split.shard_of(i) == shard])
            assert cache.settle(30)
            assert cache.usage().cached_bytes <= budget
        usage = cache.usage()
        assert usage.evictions >= 1 and usage.cached_shards <= 2
    finally:
        cache.close()


def test_a_cached_copy_that_went_bad_is_dropped_and_the_sample_read_from_the_store(
        s3_server: SeaweedFS, remote: str, local: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    try:
        split, _ = _split(s3_server, remote, cache)
        split.read_many(np.arange(len(split)))
        assert cache.settle(30)
        copy = next((tmp_path / "cache" / "shards").iterdir())
        data = bytearray(copy.read_bytes())
        data[600:700] = bytes(100)  # inside the first sample of that tar
        copy.write_bytes(bytes(data))
        expected = ShardDataset.open("local", local).splits["val"].read_many(np.arange(len(split)))
        with caplog.at_level(logging.WARNING, logger="shards.shard_cache"):
            again = split.read_many(np.arange(len(split)))
        assert all(np.array_equal(a, b) for a, b in zip(again, expected))
        assert "differs from the shard's checksums; dropped" in caplog.text and not copy.exists()
    finally:
        cache.close()


def test_a_download_that_differs_from_the_manifest_is_never_cached(
        s3_server: SeaweedFS, remote: str, local: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    cache = ShardCache(tmp_path / "cache", 1 << 30)
    try:
        tar = next((local / "val").glob("*.tar"))
        wrong = CachedShard(hashlib.sha256(b"another shard").hexdigest(), tar.stat().st_size, "s3://x/val/t.tar")
        with caplog.at_level(logging.WARNING, logger="shards.shard_cache"):
            cache.want(wrong, lambda: [memoryview(tar.read_bytes())])
            assert cache.settle(10)
        assert cache.usage().download_failures == 1 and not cache.holds(wrong)
        assert list((tmp_path / "cache" / "shards").iterdir()) == [] == list((tmp_path / "cache" / "partial").iterdir())
        assert "s3://x/val/t.tar: not cached" in caplog.text
    finally:
        cache.close()


def test_a_download_that_fails_unexpectedly_gives_its_reservation_back(tmp_path: Path) -> None:
    # Before: an exception other than a store's or the disk's kept the shard "on its
    # way" for good: never downloaded again, its bytes counted against the budget.
    cache = ShardCache(tmp_path / "cache", 1 << 20)
    shard = CachedShard(hashlib.sha256(b"x").hexdigest(), 1000, "s3://b/val/t.tar")

    def broken() -> list[memoryview]:
        raise ValueError("a bug in the chunk reader")

    try:
        cache.want(shard, broken)
        cache._fetchers.submit(lambda: None).result(timeout=10)  # queued after the download
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and cache.usage().download_failures == 0:
            time.sleep(0.01)
        assert cache.usage().download_failures == 1
        assert shard.sha256 not in cache._pending
    finally:
        cache.close()
