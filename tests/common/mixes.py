"""A second dataset for tests of mixed streams: real sample shards whose class names
overlap the sample data's in one (``n00000003``), so a mix's labels over the union of
the class names are not the datasets' own; and the truth a checker compares with."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pyarrow.parquet as pq

from shards.layout import MANIFEST_NAME, index_path
from shards.manifest import read_manifest
from shards.writers import write_manifest
from tests.common.bad_samples import copy_shards
from tests.common.shards import build_sample_shards

__all__ = ["EXTRA_CLASSES", "build_extra_shards", "labels_by_key"]

EXTRA_CLASSES = ["x-heron", "n00000003", "x-wren"]


def build_extra_shards(root: Path, train_per_class: int = 8) -> Path:
    """Another dataset under ``root``: 3 classes (:data:`EXTRA_CLASSES`), ``3 x
    train_per_class`` train images, no val split. Calls with the same arguments
    reuse it."""
    extra = Path(root) / f"extra-{train_per_class}"
    if (extra / MANIFEST_NAME).is_file():
        return extra
    built = build_sample_shards(Path(root) / "built", classes=3, train_per_class=train_per_class, val_per_class=1,
                                seed=7)
    copy = copy_shards(built, Path(root) / f".extra-{train_per_class}")
    manifest = read_manifest(copy)
    write_manifest(copy / MANIFEST_NAME, replace(manifest, classes=EXTRA_CLASSES,
                                                 splits={"train": manifest.splits["train"]}))
    copy.rename(extra)
    return extra


def labels_by_key(root: Path, name: str, union: list[str], split: str = "train") -> dict[str, int]:
    """``NAME/key`` -> the index in ``union`` of its class name, from the split's index
    and the manifest (what a mix's label must be)."""
    classes = read_manifest(root).classes
    table = pq.read_table(index_path(root, split), columns=["key", "label"]).to_pydict()
    return {f"{name}/{key}": union.index(classes[label]) for key, label in zip(table["key"], table["label"])}
