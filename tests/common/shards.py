"""Real sample shards for tests of every area: sample photos -> ``feeder shard``.

``build_sample_shards(tmp_path_factory.mktemp("shards"))`` in a session fixture gives a
shard directory made by the real sharder from the real sample data (small images so
it takes about a second). Calls with the same root and arguments reuse the result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from sharder import SampleDataConfig, ShardConfig, make_sample_data, shard
from shards.layout import MANIFEST_NAME, file_sha256, index_path
from shards.manifest import read_manifest
from shards.writers import write_manifest

__all__ = ["build_sample_shards", "build_sample_tree", "seal_index"]

SMALL_MIN_SIDE_PX = 64  # small images: fast to make, shard and decode in tests
SMALL_MAX_SIDE_PX = 112


def build_sample_tree(
    root: Path, *, classes: int = 4, train_per_class: int = 16, val_per_class: int = 4, seed: int = 0,
    side_px: tuple[int, int] = (SMALL_MIN_SIDE_PX, SMALL_MAX_SIDE_PX),
) -> Path:
    """The sample ILSVRC-shaped tree (train/<wnid>/, flat val/ + LOC_val_solution.csv),
    its images' sides between ``side_px`` (small by default)."""
    sizes = "" if side_px == (SMALL_MIN_SIDE_PX, SMALL_MAX_SIDE_PX) else f"-px{side_px[0]}-{side_px[1]}"
    src = Path(root) / f"sample-c{classes}-t{train_per_class}-v{val_per_class}-s{seed}{sizes}"
    if not (src / "LOC_synset_mapping.txt").is_file():
        config = SampleDataConfig(
            src,
            classes=classes,
            train_per_class=train_per_class,
            val_per_class=val_per_class,
            seed=seed,
            min_side_px=side_px[0],
            max_side_px=side_px[1],
        )
        make_sample_data(config)
    return src


def build_sample_shards(
    root: Path,
    *,
    classes: int = 4,
    train_per_class: int = 16,
    val_per_class: int = 4,
    seed: int = 0,
    formats: Sequence[str] = ("wds",),
    shard_size_bytes: int = 100_000,
    half_copies: bool = False,
    side_px: tuple[int, int] = (SMALL_MIN_SIDE_PX, SMALL_MAX_SIDE_PX),
) -> Path:
    """Shard the sample tree and return the shard directory (``manifest.json`` inside).

    Args:
        root: a directory owned by the caller (e.g. from ``tmp_path_factory``).
        classes / train_per_class / val_per_class / seed: sample data options.
        formats: shard formats, e.g. ``("wds", "lmdb")``.
        shard_size_bytes: small by default so that every split has several shards.
        half_copies: store half-scale copies (``feeder shard --half-copies``).
        side_px: the images' least and greatest sides (small by default: fast to make,
            shard and decode).

    Returns:
        The shard directory.
    """
    src = build_sample_tree(
        root, classes=classes, train_per_class=train_per_class, val_per_class=val_per_class, seed=seed,
        side_px=side_px,
    )
    out = Path(root) / f"shards-{src.name}-{'-'.join(formats)}-{shard_size_bytes}{'-half' if half_copies else ''}"
    if not (out / "manifest.json").is_file():
        shard(ShardConfig(src, out, formats=tuple(formats), seed=seed, shard_size_bytes=shard_size_bytes,
                          half_copies=half_copies, overwrite=True))
    return out


def seal_index(root: Path, split: str) -> None:
    """Record the index of ``split`` as it is now in the manifest's ``index_sha256``, as
    if the dataset had been sharded with it: for tests of what the reader does with an
    index of a given content, past the check that it is the manifest's."""
    manifest = read_manifest(root)
    entry = replace(manifest.splits[split], index_sha256=file_sha256(index_path(root, split)))
    write_manifest(root / MANIFEST_NAME, replace(manifest, splits={**manifest.splits, split: entry}))
