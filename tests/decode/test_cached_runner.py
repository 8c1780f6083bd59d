"""Streams served through the decoded cache: same samples and crops, first pass fills,
later passes hit, budgets hold, larger image sizes bypass, bad samples stay out, and
jobs share one cache."""

from __future__ import annotations

import gc
import inspect
import shutil
import types
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from decode.augment import centre_crops
from decode.cached_runner import CachedRunner
from decode.decoded_cache import ENTRY_OVERHEAD_BYTES, DecodedCache
from decode.jobs import Decoded, Job
from decode.pipeline import PipelineSpec
from decode.runner import PipelineRunner
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from feeder.stream_pipelines import cache_key
from protocol.plan import LastBatch
from protocol.request import StreamSpec
from protos import feeder_pb2, feeder_pb2_grpc
from shards.layout import index_path
from tests.common.bad_samples import index_as_stored
from tests.feeder.conftest import connect, start
from transport.base import Slot

SIDE = 48  # px: below the sample images' 64-112 px, so every cached image is downscaled


def _service(shards: Path, cache_bytes: int = 64 << 20, side: int = SIDE, on_error: str = "skip",
             cpu_decoder: str = "auto") -> FeederService:
    config = ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=1, max_batch_size=64,
                          decoded_cache_bytes=cache_bytes, decoded_cache_side=side, on_error=on_error,
                          cpu_decoder=cpu_decoder)
    return FeederService(config, open_datasets(config.datasets), ServerMetrics())


def _epoch(service: FeederService, **fields) -> tuple[list[str], np.ndarray]:
    base = dict(dataset="sample", split="train", batch_size=8, image_size=32, last_batch=LastBatch.PAD)
    stream = service.open_stream(StreamSpec(**(base | fields)))
    try:
        batches = list(stream)
    finally:
        stream.close()
    keys = [k for b in batches for k, pad in zip(b.meta.keys, b.meta.padding) if not pad]
    images = np.concatenate([b.images[~b.meta.padding] for b in batches])
    return keys, images


@pytest.fixture()
def cached(shards):
    service = _service(shards)
    yield service
    service.close()


def test_first_pass_fills_later_passes_hit_with_the_same_pixels(cached, index_rows):
    n = len(index_rows["train"])
    keys, first = _epoch(cached, seed=3, epoch=1)
    stats = cached.metrics.stats()
    assert sorted(keys) == sorted(index_rows["train"])
    assert (stats.decoded_cache_hits, stats.decoded_cache_misses, stats.decoded_cache_entries) == (0, n, n)
    again_keys, again = _epoch(cached, seed=3, epoch=1)
    stats = cached.metrics.stats()
    assert (stats.decoded_cache_hits, stats.decoded_cache_misses) == (n, n)
    assert again_keys == keys and np.array_equal(again, first), "a sample's pixels do not depend on hit or miss"
    assert 0 < stats.decoded_cache_bytes <= stats.decoded_cache_budget_bytes == 64 << 20


def test_cached_pixels_match_the_uncached_pipeline_when_nothing_is_downscaled(shards):
    # DALI decodes windows at full scale, as the cache does: no DCT-scaled decode.
    plain, cached = _service(shards, cache_bytes=0, cpu_decoder="dali"), _service(shards, side=1024)
    try:
        for fields in (dict(seed=5, epoch=2), dict(split="val")):
            keys, reference = _epoch(plain, **fields)
            cached_keys, images = _epoch(cached, **fields)
            assert cached_keys == keys, "the cache changes no order"
            diff = np.abs(images.astype(np.int16) - reference.astype(np.int16))
            assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 8, "same windows, same filter"
    finally:
        plain.close()
        cached.close()


def test_downscaled_cache_keeps_the_crops_where_they_were(shards):
    plain, cached = _service(shards, cache_bytes=0, cpu_decoder="dali"), _service(shards)  # full-scale windows
    try:
        _, reference = _epoch(plain, split="val", image_size=24)
        _, images = _epoch(cached, split="val", image_size=24)
        diff = np.abs(images.astype(np.int16) - reference.astype(np.int16))
        assert diff.mean() < 6.0, "a window mapped to the wrong place would differ by far more"
    finally:
        plain.close()
        cached.close()


def test_zero_budget_means_no_cache(shards):
    service = _service(shards, cache_bytes=0)
    try:
        _epoch(service)
        stats = service.metrics.stats()
        assert service.parts.decoded_cache is None
        assert (stats.decoded_cache_hits, stats.decoded_cache_misses, stats.decoded_cache_budget_bytes) == (0, 0, 0)
    finally:
        service.close()


def test_image_size_above_the_cached_side_decodes_from_jpeg_and_is_counted(cached, index_rows):
    n = len(index_rows["train"])
    keys, images = _epoch(cached, image_size=SIDE + 16)
    stats = cached.metrics.stats()
    assert sorted(keys) == sorted(index_rows["train"]) and images.shape[1:] == (SIDE + 16, SIDE + 16, 3)
    assert (stats.decoded_cache_bypassed, stats.decoded_cache_entries, stats.decoded_cache_misses) == (n, 0, 0)
    _epoch(cached, image_size=SIDE)  # the side itself is served from the cache
    assert cached.metrics.stats().decoded_cache_entries == n


def test_memory_pressure_stops_admitting_and_stays_within_budget(shards, index_rows):
    n = len(index_rows["train"])
    budget = 20 * (SIDE * 64 * 3 + ENTRY_OVERHEAD_BYTES)  # room for about 20 of the 64 images
    service = _service(shards, cache_bytes=budget)
    try:
        for epoch in range(3):
            keys, _ = _epoch(service, epoch=epoch)
            assert sorted(keys) == sorted(index_rows["train"]), "misses past the budget still arrive"
            usage = service.parts.decoded_cache.usage()
            assert usage.used_bytes <= budget and not usage.admitting
        stats = service.metrics.stats()
        assert 0 < stats.decoded_cache_entries < n
        assert stats.decoded_cache_hits == 2 * stats.decoded_cache_entries, "the admitted subset stays"
        assert stats.decoded_cache_hits + stats.decoded_cache_misses == 3 * n
    finally:
        service.close()


def _corrupt_copy(shards: Path, dest: Path, split: str, row: int) -> int:
    copy = Path(shutil.copytree(shards, dest))
    table = pq.read_table(index_path(copy, split)).to_pylist()
    with open(copy / table[row]["shard"], "r+b") as f:
        f.seek(table[row]["offset"])
        f.write(b"\x00" * table[row]["size"])
    index_as_stored(copy, split)  # undecodable as sharded, not changed since
    return row


def test_a_sample_that_fails_to_decode_is_never_cached(shards, tmp_path):
    bad = _corrupt_copy(shards, tmp_path / "bad", "val", row=5)
    service = _service(tmp_path / "bad", on_error="fail")
    try:
        for _ in range(2):
            with pytest.raises(DataError, match="decode"):
                _epoch(service, split="val", batch_size=4)
            assert service.parts.decoded_cache.get(("sample", "val", bad)) is None
        assert service.parts.decoded_cache.usage().admitting, "a bad sample does not stop admission"
        assert service.parts.decoded_cache.get(("sample", "val", 4)) is not None, "its good neighbours are cached"
    finally:
        service.close()


def _suspended_runs() -> list[object]:
    # type(), not isinstance: asking some objects for their __class__ warns.
    return [g for g in gc.get_objects() if type(g) is types.GeneratorType
            and g.gi_code is CachedRunner.run_many.__code__ and inspect.getgeneratorstate(g) == inspect.GEN_SUSPENDED]


@pytest.mark.slow
def test_a_stream_that_fails_closes_its_run_on_its_own_thread(shards, tmp_path):
    # Left to the garbage collector, a run's cleanup could run on any thread, a pool
    # worker among them, and wait there for work only that worker could do.
    _corrupt_copy(shards, tmp_path / "bad", "val", row=5)
    service = _service(tmp_path / "bad", on_error="fail")
    gc.collect()
    gc.disable()
    try:
        with pytest.raises(DataError, match="decode"):  # the error, held, holds the frames that ran
            _epoch(service, split="val", batch_size=4)
        assert _suspended_runs() == []
    finally:
        gc.enable()
        service.close()


def test_two_jobs_share_the_cache_and_each_gets_every_sample_once(shards, index_rows):
    n = len(index_rows["train"])
    server, port = start({"sample": shards}, decoded_cache_bytes=64 << 20, decoded_cache_side=SIDE)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)

            def job(number: int) -> list[str]:
                request = feeder_pb2.StreamRequest(
                    dataset="sample", split="train", job_id=f"job-{number}", seed=number, world_size=1,
                    batch_size=4, image_size=32, epochs=2, last_batch=feeder_pb2.LAST_BATCH_PAD)
                return [k for b in stub.StreamBatches(request) for k, p in zip(b.keys, b.padding) if not p]

            with ThreadPoolExecutor(2) as pool:
                per_job = list(pool.map(job, (1, 2)))
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        for keys in per_job:
            assert sorted(keys[:n]) == sorted(keys[n:]) == sorted(index_rows["train"]), "each epoch once"
        assert per_job[0][:n] != per_job[1][:n], "different seeds, different orders"
        assert stats.decoded_cache_entries == n, "decoded once for both jobs"
        assert stats.decoded_cache_hits + stats.decoded_cache_misses == 4 * n
        assert stats.decoded_cache_hits >= 2 * n, "every later epoch hits"
    finally:
        server.stop(0).wait(10)


def test_with_the_skip_policy_a_bad_sample_is_replaced_and_still_never_cached(shards, tmp_path):
    bad = _corrupt_copy(shards, tmp_path / "bad", "val", row=5)
    service = _service(tmp_path / "bad")
    try:
        for _ in range(2):
            keys, _ = _epoch(service, split="val", batch_size=4)
            assert service.parts.decoded_cache.get(("sample", "val", bad)) is None
        assert service.metrics.stats().samples_failed >= 1
    finally:
        service.close()


def test_samples_the_cache_holds_are_served_without_reading_their_bytes_again(shards, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(shards, copy)
    service = _service(copy, on_error="fail")  # a sample whose bytes were read and changed would end the stream
    try:
        keys, first = _epoch(service, seed=3, epoch=1)
        for tar in (copy / "train").glob("*.tar"):  # every byte changed, in place: reads would see zeros
            with open(tar, "r+b") as f:
                f.write(bytes(tar.stat().st_size))
        again_keys, again = _epoch(service, seed=3, epoch=1)
        assert again_keys == keys and np.array_equal(again, first)
        assert service.metrics.stats().samples_failed == 0
        with pytest.raises(DataError):  # what the cache does not hold is read, and found changed
            _epoch(service, seed=3, epoch=1, image_size=2 * SIDE)  # above the cached side: bypassed
    finally:
        service.close()


def test_a_run_closed_early_waits_for_what_it_started_and_runs_nothing_else(shards):
    split = open_datasets({"sample": shards})["sample"].splits["train"]
    metrics = ServerMetrics()
    runner = CachedRunner(PipelineRunner(PipelineSpec(max_batch_size=8, threads=1)),
                          DecodedCache(64 << 20, SIDE), split, cache_key("sample", split), metrics)

    def job(first: int) -> Job:
        indices = np.arange(first, first + 4)
        crops = centre_crops(split.widths[indices], split.heights[indices])
        return Job(split.read_many(indices), 32, crops, indices)

    slots: list[Slot] = []

    def allocate(shape: tuple[int, ...]) -> Slot:
        slots.append(Slot(pixels=np.zeros(shape, dtype=np.uint8)))
        return slots[-1]

    try:
        reference = runner.run_alone(job(0)).slot.array  # its samples are cached now; those of job(4) are not
        outcomes = runner.run_many([job(0), job(0)], allocate)
        assert isinstance(next(outcomes), Decoded)  # the second job(0) begun: its resizes started
        outcomes.close()
        assert len(slots) == 2 and np.array_equal(slots[1].array, reference), "closed after what it started"
        outcomes = runner.run_many([job(0), job(4)])
        assert isinstance(next(outcomes), Decoded)  # job(4) taken, not begun: a miss runs in its turn
        outcomes.close()
        stats = metrics.stats()
        assert (stats.decoded_cache_hits, stats.decoded_cache_misses) == (12, 4), "job(4) was never run"
    finally:
        runner.inner.close()
