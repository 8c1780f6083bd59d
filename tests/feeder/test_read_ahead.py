"""Read-ahead hints follow the reads: given while batches come from a disk, not while
they come from the page cache (where they only cost CPU)."""

from __future__ import annotations

import pytest

from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.request import StreamSpec
from shards.reader import SplitIndex


def _hints_over_one_epoch(
    shards, monkeypatch: pytest.MonkeyPatch, cached: bool, stray_misses: int = 0
) -> tuple[int, int]:
    hints = []
    will_need, read_many = SplitIndex.will_need, SplitIndex.read_many

    def counting(self, indices):
        hints.append(len(indices))
        return will_need(self, indices)

    def from_disk(self, indices, half=None):
        out = read_many(self, indices, half)
        if not cached:
            self.uncached_reads += len(indices)  # as reads the page cache could not serve count
        self.uncached_reads += stray_misses
        return out

    monkeypatch.setattr(SplitIndex, "will_need", counting)
    monkeypatch.setattr(SplitIndex, "read_many", from_disk)
    service = FeederService(ServerConfig.of(datasets={"s": shards}, device="cpu", threads=1),
                            open_datasets({"s": shards}), ServerMetrics())
    try:
        stream = service.open_stream(StreamSpec(dataset="s", split="train", batch_size=4, image_size=16))
        try:
            batches = sum(1 for _ in stream)
        finally:
            stream.close()
    finally:
        service.close()
    return len(hints), batches


def test_batches_read_from_the_page_cache_get_no_read_ahead_hints(shards, monkeypatch):
    hints, batches = _hints_over_one_epoch(shards, monkeypatch, cached=True)
    assert batches > 4
    assert hints <= 1  # before the first read shows where the data is


def test_batches_read_from_disk_get_a_hint_for_the_next_batch_each(shards, monkeypatch):
    hints, batches = _hints_over_one_epoch(shards, monkeypatch, cached=False)
    assert hints == batches - 1  # every batch but the last has one behind it


def test_a_stray_miss_in_a_cached_batch_brings_no_hints_back(shards, monkeypatch):
    # The page cache turns a read away now and then even for a file it holds.
    hints, batches = _hints_over_one_epoch(shards, monkeypatch, cached=True, stray_misses=1)
    assert batches > 4
    assert hints <= 1
