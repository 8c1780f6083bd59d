"""Streams over shards with half-scale copies (``feeder shard --half-copies``): a
window at least twice the output is decoded from the copy, every other one from the
image; the decoded cache always takes the images."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from decode.augment import sample_crops
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.producer import ReadyBatch
from feeder.service import FeederService, open_datasets
from protocol.plan import LastBatch
from protocol.request import AugmentKind, CropRange, StreamSpec
from shards import jpeg
from shards.layout import index_path
from shards.reader import ShardDataset
from tests.common.bad_samples import index_as_stored
from tests.common.shards import build_sample_shards

SIZE = 24  # px: most windows of the 64-112 px sample images are at least twice it


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("half-streams")
    return build_sample_shards(root), build_sample_shards(root, half_copies=True)


def _service(shards: Path, cache_bytes: int = 0) -> FeederService:
    config = ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=1, max_batch_size=64,
                          decoded_cache_bytes=cache_bytes, decoded_cache_side=48)
    return FeederService(config, open_datasets(config.datasets), ServerMetrics())


def _batches(service: FeederService, **fields) -> list[ReadyBatch]:
    """One stream's batches (train, batches of 8 padded, ``SIZE`` px unless ``fields`` say)."""
    base = dict(dataset="sample", split="train", batch_size=8, image_size=SIZE, last_batch=LastBatch.PAD)
    stream = service.open_stream(StreamSpec(**(base | fields)))
    try:
        return list(stream)
    finally:
        stream.close()


def _keys(batches: list[ReadyBatch]) -> list[str]:
    return [k for b in batches for k, pad in zip(b.meta.keys, b.meta.padding) if not pad]


def _epoch(shards: Path, cache_bytes: int = 0, **fields) -> tuple[list[str], np.ndarray]:
    service = _service(shards, cache_bytes)
    try:
        batches = _batches(service, **fields)
    finally:
        service.close()
    return _keys(batches), np.concatenate([b.images[~b.meta.padding] for b in batches]).astype(np.int16)


def _damaged(halves: Path, tmp_path: Path, row: int, *fields: str) -> tuple[Path, list[dict], dict]:
    """A copy of ``halves`` whose ``row``-th train sample has 64 zero bytes written at
    each of ``fields`` (``offset``: its image, ``half_offset``: its copy): no JPEG
    headers there any more. Returns the shards, their index rows and that row."""
    shards = tmp_path / "shards"
    shutil.copytree(halves, shards)
    rows = pq.read_table(index_path(shards, "train")).to_pylist()
    damaged = rows[row]
    with open(shards / damaged["shard"], "r+b") as f:
        for field in fields:
            f.seek(damaged[field])
            f.write(bytes(64))
    index_as_stored(shards, "train")  # undecodable as sharded, not changed since
    return shards, rows, damaged


# Windows of at least half the area of 64-112 px images are at least twice 16 px on
# both sides: every sample is decoded from its copy while it can be.
_FROM_COPIES = dict(image_size=16, crop=CropRange(min_scale=0.5))


def test_windows_twice_the_output_come_from_the_copies_the_rest_from_the_images(both) -> None:
    plain, halves = both
    keys, from_images = _epoch(plain, seed=4, epoch=1)
    half_keys, from_copies = _epoch(halves, seed=4, epoch=1)
    assert half_keys == keys and len(set(keys)) == len(keys), "the same samples, each once, in the same order"
    split = ShardDataset.open("s", halves).splits["train"]
    rows = np.array([split.keys.index(k) for k in keys])
    crops = sample_crops(AugmentKind.TRAIN, 4, 1, keys, split.widths[rows], split.heights[rows], CropRange())
    twice = np.array([jpeg.dct_denominator(int(w), int(h), SIZE) >= 2 for w, h in crops.boxes[:, 2:]])
    assert 0 < twice.sum() < len(keys)
    assert (from_copies[~twice] == from_images[~twice]).all()
    differs = np.abs(from_copies[twice] - from_images[twice]).mean(axis=(1, 2, 3))
    assert (differs > 0).mean() > 0.5, "decoded from other bytes"
    assert differs.mean() < 12, "but the same window"


def test_the_decoded_cache_takes_the_images_not_the_copies(both) -> None:
    plain, halves = both
    keys, from_images = _epoch(plain, cache_bytes=64 << 20, seed=2, epoch=3)
    half_keys, from_halves = _epoch(halves, cache_bytes=64 << 20, seed=2, epoch=3)
    assert half_keys == keys and sorted(keys) == sorted(set(keys))
    assert (from_halves == from_images).all()


def test_a_copy_that_does_not_decode_is_replaced_by_its_image_not_the_sample(
    both, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    shards, rows, damaged = _damaged(both[1], tmp_path, 5, "half_offset")
    service = _service(shards)
    with caplog.at_level(logging.WARNING, logger="feeder.producer"):
        for epoch in (0, 1):  # the second epoch reads the image straight away
            batches = _batches(service, epoch=epoch, **_FROM_COPIES)
            assert sorted(_keys(batches)) == sorted(r["key"] for r in rows), "every sample once, the damaged one too"
            assert not [k for b in batches for k in b.meta.failed_keys]
    service.close()
    warnings = [r.getMessage() for r in caplog.records if "half-scale copy" in r.getMessage()]
    assert len(warnings) == 1 and damaged["key"] in warnings[0] and damaged["shard"] in warnings[0]


def test_a_sample_whose_copy_and_image_both_fail_is_replaced_once(both, tmp_path: Path) -> None:
    shards, rows, damaged = _damaged(both[1], tmp_path, 7, "offset", "half_offset")
    service = _service(shards)
    try:
        batches = _batches(service, **_FROM_COPIES)
    finally:
        service.close()
    assert sorted(_keys(batches)) == sorted(r["key"] for r in rows if r is not damaged)
    assert [k for b in batches for k in b.meta.failed_keys] == [damaged["key"]]
