"""Streams over shards with half-scale copies (``feeder shard --half-copies``): a
window at least twice the output is decoded from the copy, every other one from the
image; the decoded cache always takes the images."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from feeder.augment import AugmentKind, CropRange, sample_crops
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.plan import LastBatch
from feeder.service import FeederService, StreamSpec, open_datasets
from shards import jpeg
from shards.reader import ShardDataset
from tests.common.shards import build_sample_shards

SIZE = 24  # px: most windows of the 64-112 px sample images are at least twice it


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("half-streams")
    return build_sample_shards(root), build_sample_shards(root, half_copies=True)


def _epoch(shards: Path, cache_bytes: int = 0, **fields) -> tuple[list[str], np.ndarray]:
    config = ServerConfig(datasets={"sample": shards}, device="cpu", threads=1, max_batch_size=64,
                          decoded_cache_bytes=cache_bytes, decoded_cache_side=48)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    base = dict(dataset="sample", split="train", batch_size=8, image_size=SIZE, last_batch=LastBatch.PAD)
    stream = service.open_stream(StreamSpec(**(base | fields)))
    try:
        batches = list(stream)
    finally:
        stream.close()
        service.close()
    keys = [k for b in batches for k, pad in zip(b.keys, b.padding) if not pad]
    return keys, np.concatenate([b.images[~b.padding] for b in batches]).astype(np.int16)


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
