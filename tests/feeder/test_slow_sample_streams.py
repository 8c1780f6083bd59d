"""Streams over data with a few very large images, through the daemon's service: with
the look-ahead (``--lookahead``) their windows start decoding ahead of their batches,
counted in ``samples_decoded_early``, and each epoch still delivers every sample once,
with its own label and the very pixels a stream without the look-ahead delivers."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from PIL import Image

from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.batch import BatchMeta
from protocol.request import StreamSpec
from sharder import ShardConfig, shard
from shards import jpeg
from shards.layout import index_path
from tests.common.shards import build_sample_tree

pytestmark = [pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason())), pytest.mark.slow]

BATCH, SIZE, EPOCHS = 8, 24, 2


@pytest.fixture(scope="module")
def large_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The small sample tree (64-112 px) with 3 of its 48 training images at 1600x1200."""
    root = tmp_path_factory.mktemp("slow-streams")
    src = build_sample_tree(root, classes=2, train_per_class=24, val_per_class=2)
    tree = root / "tree"
    train = sorted(p for p in (src / "train").rglob("*") if p.is_file())
    large = set(train[5::16])
    yy, xx = np.mgrid[0:1200, 0:1600]
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        target = tree / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path in large:
            noise = np.random.default_rng(len(path.name)).integers(0, 40, (1200, 1600, 3))
            pixels = np.stack([xx % 256, yy % 256, (xx + yy) % 256], axis=2) + noise
            Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(target, format="JPEG", quality=85)
        else:
            os.link(path, target)
    out = root / "shards"
    shard(ShardConfig(tree, out, seed=0))
    return out


def _stream(shards: Path, lookahead: int) -> tuple[list[tuple[BatchMeta, np.ndarray]], int]:
    config = ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=2, max_batch_size=64,
                          lookahead=lookahead)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    try:
        stream = service.open_stream(StreamSpec(dataset="sample", split="train", batch_size=BATCH, image_size=SIZE,
                                                epochs=EPOCHS))
        try:
            copies = [(b.meta, b.images.copy()) for b in stream]
        finally:
            stream.close()
        return copies, service.metrics.stats().samples_decoded_early
    finally:
        service.close()


def test_large_images_decode_early_and_every_sample_comes_once_with_the_same_pixels(large_shards: Path) -> None:
    plain, none_early = _stream(large_shards, lookahead=0)
    ahead, early = _stream(large_shards, lookahead=4)
    assert none_early == 0 and early > 0
    rows = pq.read_table(index_path(large_shards, "train"), columns=["key", "label"]).to_pydict()
    labels = dict(zip(rows["key"], rows["label"]))
    per_epoch: dict[int, list[str]] = {}
    for (meta, pixels), (other_meta, other_pixels) in zip(plain, ahead, strict=True):
        assert meta.epoch == other_meta.epoch and meta.cursor == other_meta.cursor
        assert list(meta.keys) == list(other_meta.keys)
        assert np.array_equal(pixels, other_pixels)
        assert [labels[k] for k in meta.keys] == list(other_meta.labels)
        per_epoch.setdefault(other_meta.epoch, []).extend(other_meta.keys)
    assert len(per_epoch) == EPOCHS
    for keys in per_epoch.values():
        assert sorted(keys) == sorted(labels)  # 48 samples in batches of 8: each once, none padded
