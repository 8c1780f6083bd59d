"""The node cache under shuffled reads of a remote split (a real S3 server): a cold
shard's bytes come from the store once, however the reads and the download meet, and
a split twice the cache's budget keeps the half it cached instead of churning."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from bench.seaweedfs import SeaweedFS
from sharder import SampleDataConfig, ShardConfig, make_sample_data, shard
from shards.ranged import RemoteAccess
from shards.reader import ShardDataset, SplitIndex
from shards.shard_cache import ShardCache
from shards.store import StoreCounters, StoreOptions
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree

BATCH = 8


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """About 8 shards of 1 MB holding images of ImageNet's sizes (tens of KB each)."""
    root = tmp_path_factory.mktemp("cold-source")
    make_sample_data(SampleDataConfig(root / "src", classes=4, train_per_class=40, val_per_class=2))
    out = root / "shards"
    shard(ShardConfig(root / "src", out, shard_size_bytes=1 << 20, half_copies=True))
    return out


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, local: Path) -> str:
    return upload_tree(s3_server, local, f"s3://{fresh_bucket(s3_server, 'cold')}/shards")


def _split(server: SeaweedFS, url: str, cache: ShardCache) -> tuple[SplitIndex, StoreCounters]:
    counters = StoreCounters()
    access = RemoteAccess(StoreOptions(endpoint_url=server.endpoint_url), counters, cache)
    with pointed_at(server):
        return ShardDataset.open("remote", url, remote=access).splits["train"], counters


def _dataset_bytes(local: Path) -> int:
    return sum(p.stat().st_size for p in (local / "train").glob("*.tar"))


def _epoch(split: SplitIndex, counters: StoreCounters, epoch: int, expected: list[np.ndarray]) -> int:
    """Reads a shuffled epoch in batches, each checked against the local bytes (the
    next batch read ahead, as the daemon does); returns the store bytes it took."""
    before = counters.snapshot()["bytes"]
    order = np.random.default_rng(epoch).permutation(len(split))
    batches = [order[i:i + BATCH] for i in range(0, len(order), BATCH)]
    for i, batch in enumerate(batches):
        if i + 1 < len(batches):
            split.will_need(batches[i + 1])
        for index, got in zip(batch, split.read_many(batch)):
            assert np.array_equal(got, expected[index]), f"sample {index} of epoch {epoch}"
    return counters.snapshot()["bytes"] - before


def _expected(local: Path) -> list[np.ndarray]:
    split = ShardDataset.open("local", local).splits["train"]
    return split.read_many(np.arange(len(split)))


@pytest.mark.slow
def test_a_cold_epoch_takes_each_byte_from_the_store_once(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    # Before: the samples read while a shard was downloaded were fetched twice, once
    # by their ranged GETs and again by the whole-shard download (about 1.2x here).
    cache = ShardCache(tmp_path / "cache", 1 << 30, fetch_threads=2)
    try:
        split, counters = _split(s3_server, remote, cache)
        expected, opened = _expected(local), counters.snapshot()["bytes"]
        _epoch(split, counters, 1, expected)
        assert cache.settle(30)
        ratio = (counters.snapshot()["bytes"] - opened) / _dataset_bytes(local)
        print(f"cold epoch and the copies it made: {ratio:.3f}x the dataset's bytes from the store")
        assert ratio <= 1.05
        assert cache.usage().downloads == len(list((local / "train").glob("*.tar")))
        assert _epoch(split, counters, 2, expected) == 0
    finally:
        cache.close()


def test_a_split_twice_the_budget_keeps_its_cached_half(
        s3_server: SeaweedFS, local: Path, remote: str, tmp_path: Path) -> None:
    # Before: each download evicted the least recently used copy, in use as much as
    # any other under shuffled reads, so every epoch fetched about the whole split
    # again and the cache only churned.
    dataset = _dataset_bytes(local)
    cache = ShardCache(tmp_path / "cache", dataset // 2, fetch_threads=2)
    try:
        split, counters = _split(s3_server, remote, cache)
        expected = _expected(local)
        _epoch(split, counters, 1, expected)
        assert cache.settle(30)
        held = cache.usage().cached_bytes
        later = []
        for epoch in (2, 3, 4):
            later.append(_epoch(split, counters, epoch, expected) / dataset)
            assert cache.settle(30)
        usage = cache.usage()
        print(f"cache at half the split: epochs 2-4 took {', '.join(f'{r:.2f}' for r in later)}x the split "
              f"from the store; {held / dataset:.2f} of it cached; {usage.evictions} evictions")
        assert usage.evictions == 0 and usage.cached_bytes == held >= dataset // 4
        # Only the uncached shards come from the store (their merged ranged reads take
        # some bytes between samples too, a few of them twice an epoch); churn was 7x.
        assert max(later) <= 1.25 * (1 - held / dataset)
    finally:
        cache.close()
