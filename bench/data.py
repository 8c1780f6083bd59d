"""The data a benchmark reads: a user's shard directory, or the sample data made once.

The default is the sample ILSVRC-shaped tree (ImageNet-like 300-500 px JPEGs) and its
shards, kept side by side in a cache folder so the ``torchvision`` loader can read the
very JPEGs the shards hold.
"""

from __future__ import annotations

import shutil
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path

from bench.loaders.store_peers import built_once
from sharder import SampleDataConfig, ShardConfig, make_sample_data, shard
from sharder.sample_data import sample_wnid
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


def prepare_sample(cache: Path, seed: int = 0, train_per_class: int = SAMPLE_TRAIN_PER_CLASS,
                   workers: int = 1) -> BenchData:
    """The sample tree and its shards under ``cache``, made on first use (about a minute
    at the default ``train_per_class``, ten classes, on one CPU; ``workers`` processes
    make and shard it in parallel), and the shards made again when the
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
    return _built(cache / name, train_per_class, seed, workers=workers)


def prepare_store_sample(cache: Path, train_per_class: int, seed: int = 0) -> BenchData:
    """A larger sample for the object-store bench, made once under ``cache``: ten classes
    of ``train_per_class`` training images (an epoch long enough to time, several
    shards per loader worker), in shards of ``STORE_SHARD_BYTES``, with half-scale
    copies as in :func:`prepare_sample`, and made again as those are.

    Returns:
        ``cache/store-sample-N/shards`` and ``cache/store-sample-N/src``.
    """
    return _built(cache / f"store-sample-{train_per_class}", train_per_class, seed, shard_size_bytes=STORE_SHARD_BYTES)


def _built(root: Path, train_per_class: int, seed: int, shard_size_bytes: int | None = None,
           workers: int = 1) -> BenchData:
    """``root/src``, a sample tree of ten classes of ``train_per_class`` training images,
    and ``root/shards`` (half-scale copies; tars of ``shard_size_bytes``, the sharder's
    default for None), each made once by ``workers`` processes; the shards made again
    when the sharder's options have changed since."""
    root.mkdir(parents=True, exist_ok=True)
    src, shards = root / "src", root / "shards"
    sample = SampleDataConfig(src, train_per_class=train_per_class, seed=seed)
    built_once(src, lambda tmp: _make_tree(replace(sample, out=tmp), workers))
    config = ShardConfig(src, shards, seed=seed, half_copies=True, progress=True, workers=workers)
    if shard_size_bytes is not None:
        config = replace(config, shard_size_bytes=shard_size_bytes)
    if (shards / MANIFEST_NAME).is_file() and read_manifest(shards).options != config.options():
        shutil.rmtree(shards)  # made with other options (an older sharder's defaults): made again
    built_once(shards, lambda tmp: shard(replace(config, out=tmp)))
    return BenchData(shards, src)


def _make_tree(sample: SampleDataConfig, workers: int) -> None:
    """``sample``'s tree, made by ``workers`` processes at once: each makes a tree of
    its share of every class's training images (the first, the validation images too)
    from a seed of its own, and the shares are numbered on into the first's."""
    if workers < 2 or sample.train_per_class < 2 * workers:
        make_sample_data(sample)
        return
    shares = [sample.train_per_class // workers + (i < sample.train_per_class % workers) for i in range(workers)]
    parts = [replace(sample, out=sample.out.with_name(f"{sample.out.name}-{i}"), train_per_class=share,
                     val_per_class=sample.val_per_class if i == 0 else 0, seed=sample.seed * 1000 + i, progress=False)
             for i, share in enumerate(shares)]
    for part in parts:
        shutil.rmtree(part.out, ignore_errors=True)
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(make_sample_data, parts))
    parts[0].out.rename(sample.out)
    offset = shares[0]
    for part, share in zip(parts[1:], shares[1:], strict=True):
        for index in range(sample.classes):
            wnid = sample_wnid(index)
            for n in range(1, share + 1):
                (part.out / "train" / wnid / f"{wnid}_{n}.JPEG").rename(
                    sample.out / "train" / wnid / f"{wnid}_{n + offset}.JPEG")
        shutil.rmtree(part.out)
        offset += share


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
