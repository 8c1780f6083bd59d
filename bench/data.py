"""The data a benchmark reads: a user's shard directory, or the sample data made once.

The default is the sample ILSVRC-shaped tree (ImageNet-like 300-500 px JPEGs) and its
shards, kept side by side in a cache folder so the ``torchvision`` loader can read the
very JPEGs the shards hold.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass, replace
from pathlib import Path

from bench.loaders.store_peers import built_once
from sharder import SampleDataConfig, ShardConfig, make_sample_data, shard
from shards.layout import MANIFEST_NAME
from shards.manifest import read_manifest

__all__ = [
    "SAMPLE_TRAIN_PER_CLASS", "STORE_SHARD_BYTES", "BenchData", "prepare_sample", "prepare_store_sample", "resolve",
]

# Training images per class of the default sample (``feeder sample-data``'s default).
SAMPLE_TRAIN_PER_CLASS = 100
# Shard size of the object-store sample: 64 MiB, the MDS and LitData writers' default
# shard and chunk size, so every loader fetches objects of about the same size.
STORE_SHARD_BYTES = 64 << 20


@dataclass(frozen=True)
class BenchData:
    """Shards and the JPEG tree they were made from (None when unknown)."""

    shards: Path
    source: Path | None


def prepare_sample(cache: Path, seed: int = 0, train_per_class: int = SAMPLE_TRAIN_PER_CLASS) -> BenchData:
    """The sample tree and its shards under ``cache``, made on first use (about a minute
    at the default ``train_per_class``, ten classes), and the shards made again when the
    sharder's options have changed since. The
    shards have half-scale copies (``feeder shard --half-copies``), which feeder
    decodes windows at least twice the output from (most 128 px windows); the other
    loaders read the images, as feeder does at 224 px but for the rare window of 448
    px or more.

    Returns:
        ``cache/sample/shards`` and ``cache/sample/src`` (``sample-N`` for another
        ``train_per_class``).
    """
    name = "sample" if train_per_class == SAMPLE_TRAIN_PER_CLASS else f"sample-{train_per_class}"
    return _built(cache / name, train_per_class, seed)


def prepare_store_sample(cache: Path, train_per_class: int, seed: int = 0) -> BenchData:
    """A larger sample for the object-store bench, made once under ``cache``: ten classes
    of ``train_per_class`` training images (an epoch long enough to time, several
    shards per loader worker), in shards of ``STORE_SHARD_BYTES``, with half-scale
    copies as in :func:`prepare_sample`, and made again as those are.

    Returns:
        ``cache/store-sample-N/shards`` and ``cache/store-sample-N/src``.
    """
    return _built(cache / f"store-sample-{train_per_class}", train_per_class, seed, shard_size_bytes=STORE_SHARD_BYTES)


def _built(root: Path, train_per_class: int, seed: int, shard_size_bytes: int | None = None) -> BenchData:
    """``root/src``, a sample tree of ten classes of ``train_per_class`` training images,
    and ``root/shards`` (half-scale copies; tars of ``shard_size_bytes``, the sharder's
    default for None), each made once; the shards made again when the sharder's options
    have changed since."""
    root.mkdir(parents=True, exist_ok=True)
    src, shards = root / "src", root / "shards"
    sample = SampleDataConfig(src, train_per_class=train_per_class, seed=seed)
    built_once(src, lambda tmp: make_sample_data(replace(sample, out=tmp)))
    config = ShardConfig(src, shards, seed=seed, half_copies=True, progress=True)
    if shard_size_bytes is not None:
        config = replace(config, shard_size_bytes=shard_size_bytes)
    if (shards / MANIFEST_NAME).is_file() and read_manifest(shards).options != config.options():
        shutil.rmtree(shards)  # made with other options (an older sharder's defaults): made again
    built_once(shards, lambda tmp: shard(replace(config, out=tmp)))
    return BenchData(shards, src)


def resolve(shards: Path, source: Path | None) -> BenchData:
    """A user's shard directory, with ``source`` or else the tree its manifest names.

    Raises:
        FileNotFoundError: ``shards`` has no manifest.
    """
    manifest_path = shards / MANIFEST_NAME
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{manifest_path} not found; is {shards} a directory made by 'feeder shard'?")
    if source is None:
        recorded = read_manifest(shards).source
        source = Path(recorded) if recorded and Path(recorded).is_dir() else None
    return BenchData(shards, source)
