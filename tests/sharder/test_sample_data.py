"""sharder.sample_data: an ILSVRC-shaped tree of real photographs, reproducible."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
from PIL import Image

from core.errors import ConfigError
from sharder import SampleDataConfig, make_sample_data
from sharder.sample_data import PHOTO_NAMES


def _files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _make(out: Path, seed: int = 0) -> Path:
    return make_sample_data(
        SampleDataConfig(out, classes=3, train_per_class=2, val_per_class=2, seed=seed, min_side_px=60, max_side_px=90)
    )


def test_layout_sizes_and_labels(tmp_path: Path) -> None:
    root = _make(tmp_path / "a")
    files = _files(root)
    train = [f for f in files if f.startswith("train/")]
    assert sorted(train) == [f"train/n0000000{c}/n0000000{c}_{n}.JPEG" for c in (1, 2, 3) for n in (1, 2)]
    assert sorted(f for f in files if f.startswith("val/")) == [f"val/ILSVRC2012_val_{n:08d}.JPEG" for n in range(1, 7)]
    for name in train:
        with Image.open(root / name) as image:
            assert image.format == "JPEG" and 60 <= min(image.size) <= max(image.size) <= 90
    with open(root / "LOC_val_solution.csv", newline="") as f:
        labels = [row["PredictionString"].split()[0] for row in csv.DictReader(f)]
    assert sorted(labels) == ["n00000001", "n00000001", "n00000002", "n00000002", "n00000003", "n00000003"]
    mapping = (root / "LOC_synset_mapping.txt").read_text().splitlines()
    assert mapping == [f"n0000000{i + 1} {PHOTO_NAMES[i]}" for i in range(3)]


def test_same_seed_same_bytes_other_seed_other_bytes(tmp_path: Path) -> None:
    a, b, c = _files(_make(tmp_path / "a")), _files(_make(tmp_path / "b")), _files(_make(tmp_path / "c", seed=1))
    assert a == b
    assert a.keys() == c.keys() and a != c


def test_every_bundled_photograph_loads(tmp_path: Path) -> None:
    config = SampleDataConfig(
        tmp_path / "all", classes=len(PHOTO_NAMES), train_per_class=1, val_per_class=0, min_side_px=32, max_side_px=40
    )
    root = make_sample_data(config)
    assert len(list(root.glob("train/*/*.JPEG"))) == len(PHOTO_NAMES)


def test_too_many_classes_or_non_empty_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="at most"):
        make_sample_data(SampleDataConfig(tmp_path / "x", classes=len(PHOTO_NAMES) + 1))
    (tmp_path / "y").mkdir()
    (tmp_path / "y" / "f").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        make_sample_data(SampleDataConfig(tmp_path / "y", classes=1))


def test_unwritable_out_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError, match="cannot write"):
        make_sample_data(SampleDataConfig(tmp_path / "file" / "data", classes=1, train_per_class=1, val_per_class=0))
