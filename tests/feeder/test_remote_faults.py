"""Faults of a real S3 server under a serving daemon: the store killed mid-epoch and
restarted (streams wait and retry, every sample delivered once, the local dataset
served meanwhile), a shard deleted from the bucket mid-epoch (the error policy,
naming the URL), and the first batch of a stream on a cold cache coming from
ranged reads, before any shard download is done."""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import grpc
import pytest

from bench.seaweedfs import SeaweedFS
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.s3 import fresh_bucket, pointed_at, store_of, upload_tree
from tests.common.waiting import wait_for
from tests.feeder.conftest import connect, request, start


def _keys(batches) -> Counter[str]:
    return Counter(key for b in batches for key, pad in zip(b.keys, b.padding) if not pad)


def _serve(server: SeaweedFS, datasets: dict, **options):
    with pointed_at(server):
        return start(datasets, s3_endpoint=server.endpoint_url, **options)


@pytest.mark.slow
def test_a_store_killed_mid_epoch_and_restarted_loses_and_repeats_nothing(
        s3_server: SeaweedFS, shards: Path, index_rows: dict) -> None:
    url = upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'restart')}/sample")
    daemon, port = _serve(s3_server, {"remote": url, "local": shards}, queue_batches=1, prefetch=1)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            fields = dict(split="train", batch_size=4, image_size=96, epochs=3)
            stream = stub.StreamBatches(request(dataset="remote", **fields))
            batches = [next(stream) for _ in range(3)]
            s3_server.stop(kill=True)
            try:
                local = list(stub.StreamBatches(request(dataset="local", split="val", batch_size=4, image_size=16)))
                assert sum(_keys(local).values()) == len(index_rows["val"])  # served while the store is down
                # The remote stream's reads fail and are retried meanwhile.
                assert wait_for(lambda: stub.GetStats(feeder_pb2.StatsRequest()).store_retries > 0, timeout_s=60)
            finally:
                s3_server.start()
            batches += list(stream)
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        by_epoch = [_keys(b for b in batches if b.epoch == epoch) for epoch in (0, 1, 2)]
        assert all(keys == Counter(index_rows["train"].keys()) for keys in by_epoch)  # each sample once an epoch
        assert stats.store_retries > 0 and stats.samples_failed == 0
    finally:
        daemon.stop(0).wait(10)


@pytest.fixture()
def deletable(s3_server: SeaweedFS, shards: Path) -> str:
    return upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'deleted')}/sample")


def _delete_a_shard_mid_epoch(server: SeaweedFS, url: str, stub, **fields) -> tuple[list, str, grpc.RpcError | None]:
    """Stream the train split, delete a tar it has not read yet after the first
    batch; (the batches, the tar's URL, the error the stream ended with)."""
    stream = stub.StreamBatches(request(dataset="remote", split="train", batch_size=4, image_size=16, **fields))
    batches = [next(stream)]
    store = store_of(server, url)
    tars = sorted(name for name in store.listing() if name.startswith("train/") and name.endswith(".tar"))
    store.delete([tars[-1]])
    try:
        batches += list(stream)
    except grpc.RpcError as e:
        return batches, f"{url}/{tars[-1]}", e
    return batches, f"{url}/{tars[-1]}", None


@pytest.mark.slow
def test_a_shard_deleted_mid_epoch_is_skipped_under_skip_naming_its_url(
        s3_server: SeaweedFS, shards: Path, deletable: str, index_rows: dict) -> None:
    # A shard gone for good: past a short heal window (its samples read again for it).
    daemon, port = _serve(s3_server, {"remote": deletable, "local": shards}, queue_batches=1, prefetch=1,
                          max_failed_batch_fraction=1.0, max_failed_epoch_fraction=0.9, store_heal_s=0.5)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            batches, gone, error = _delete_a_shard_mid_epoch(s3_server, deletable, stub)
            assert error is None
            stats = stub.GetStats(feeder_pb2.StatsRequest())
            local = list(stub.StreamBatches(request(dataset="local", split="val", batch_size=4, image_size=16)))
        delivered = _keys(batches)
        assert max(delivered.values()) == 1 and set(delivered) <= set(index_rows["train"])
        failed = {b for batch in batches for b in batch.failed_keys}
        assert failed and not failed & set(delivered) and set(delivered) | failed == set(index_rows["train"])
        assert stats.samples_failed == len(failed)
        assert stats.failed_keys and all(gone in line and "404 Not Found" in line for line in stats.failed_keys)
        assert sum(_keys(local).values()) == len(index_rows["val"])  # the daemon serves its other datasets
    finally:
        daemon.stop(0).wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("on_error", ["skip", "fail"])
def test_a_shard_deleted_mid_epoch_ends_the_stream_naming_its_url_past_the_limits(
        s3_server: SeaweedFS, shards: Path, deletable: str, index_rows: dict, on_error: str) -> None:
    daemon, port = _serve(s3_server, {"remote": deletable, "local": shards}, queue_batches=1, prefetch=1,
                          on_error=on_error, store_heal_s=0.5)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            batches, gone, error = _delete_a_shard_mid_epoch(s3_server, deletable, stub)
            local = list(stub.StreamBatches(request(dataset="local", split="val", batch_size=4, image_size=16)))
        assert error is not None and error.code() == grpc.StatusCode.DATA_LOSS
        assert gone in error.details()
        if on_error == "fail":
            assert "cannot be read: does not exist (404 Not Found" in error.details()
        delivered = _keys(batches)
        assert max(delivered.values()) == 1 and set(delivered) < set(index_rows["train"])  # none twice
        assert sum(_keys(local).values()) == len(index_rows["val"])  # the daemon serves its other datasets
    finally:
        daemon.stop(0).wait(10)


def test_the_first_batch_on_a_cold_cache_comes_before_any_shard_is_downloaded(
        s3_server: SeaweedFS, shards: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    url = upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'cold')}/sample")
    # 2 KB/s: a shard's download takes its 100 KB / 2 KB/s = 50 s, however slowly
    # the machine builds the stream's pipeline, and the stop cuts it short.
    daemon, port = _serve(s3_server, {"remote": url}, cache_dir=tmp_path / "cache", cache_fetch_bytes_per_s=2_000)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            started = time.perf_counter()
            first = next(stub.StreamBatches(request(dataset="remote", split="train", batch_size=8, image_size=16)))
            waited_s = time.perf_counter() - started
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        assert len(first.keys) == 8
        # Ranged reads, not a finished copy (samples whose bytes other reads brought
        # into the copy being made count as hits).
        assert stats.shard_cache_downloads == 0 and stats.shard_cache_misses >= 1
        assert stats.shard_cache_hits + stats.shard_cache_misses >= 8
        _prometheus_has_the_store_and_cache_counters(daemon, stats)
        with capsys.disabled():
            print(f"\nfirst batch on a cold cache: {waited_s:.2f} s")
    finally:
        daemon.stop(0).wait(10)


def _prometheus_has_the_store_and_cache_counters(daemon, stats) -> None:
    """Each counter of GetStats is in Prometheus too, at least as high (read later)."""
    value = daemon.metrics.registry.get_sample_value
    pairs = {"feeder_store_requests_total": stats.store_requests, "feeder_store_retries_total": stats.store_retries,
             "feeder_store_bytes_fetched_total": stats.store_bytes_fetched,
             "feeder_shard_cache_downloads_total": stats.shard_cache_downloads,
             "feeder_shard_cache_evictions_total": stats.shard_cache_evictions,
             "feeder_shard_cache_bytes": stats.shard_cache_bytes}
    for name, reported in pairs.items():
        assert value(name) is not None and value(name) >= reported, name
    assert value("feeder_shard_cache_samples_total", {"outcome": "miss"}) >= stats.shard_cache_misses
    assert value("feeder_shard_cache_samples_total", {"outcome": "hit"}) >= stats.shard_cache_hits
    assert value("feeder_shard_cache_budget_bytes") == stats.shard_cache_budget_bytes > 0
