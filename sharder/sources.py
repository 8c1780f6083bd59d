"""Find the samples of an input tree: which files, which split, which label.

Layouts:

- ILSVRC2012: ``SRC/train/<class>/**`` and optionally ``SRC/val/``, either in class
  folders or flat with a ground-truth file in SRC or SRC/val. SRC may also be the
  root of a Kaggle download, whose images are in ``ILSVRC/Data/CLS-LOC/{train,val}``
  and whose ``LOC_val_solution.csv`` is at the root. Ground-truth files:
  ``LOC_val_solution.csv`` (Kaggle; label = first token of PredictionString) or
  ``ILSVRC2012_validation_ground_truth.txt`` (devkit; line i holds the 1-based
  ILSVRC2012_ID of ``ILSVRC2012_val_<i>``). Devkit ids are *not* sorted-wnid order:
  they are mapped through the devkit's own synset order, read from ``meta.mat``
  (``ILSVRC2012_devkit_t12/data/meta.mat``, or copied into SRC or SRC/val) or from
  ``ILSVRC2012_devkit_synsets.txt`` (one wnid per line, line i = ILSVRC2012_ID i).
- Anything else: a plain class-folder tree ``SRC/<class>/**``, one split ``train``.

Labels are indices in sorted class-name order. Files with an image extension are
samples; every other file under a split is ignored and counted.
"""

from __future__ import annotations

import csv
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError, NotFound

__all__ = ["IMAGE_EXTENSIONS", "SourceFile", "SourceTree", "SplitSource", "find_sources"]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})
KAGGLE_GROUND_TRUTH = "LOC_val_solution.csv"
DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_SYNSETS = "ILSVRC2012_devkit_synsets.txt"
DEVKIT_META = "meta.mat"
DEVKIT_DATA = Path("ILSVRC2012_devkit_t12") / "data"
KAGGLE_DATA = Path("ILSVRC") / "Data" / "CLS-LOC"  # where a Kaggle download keeps train/ and val/
_METADATA_NAMES = {KAGGLE_GROUND_TRUTH, DEVKIT_GROUND_TRUTH, DEVKIT_SYNSETS, DEVKIT_META, "LOC_synset_mapping.txt"}


@dataclass(frozen=True)
class SourceFile:
    """One input sample: ``source`` is its path relative to SRC (POSIX form)."""

    source: str
    label: int


@dataclass
class SplitSource:
    """The inputs of one split, sorted by source path."""

    name: str
    files: list[SourceFile] = field(default_factory=list)
    ignored: int = 0
    rejects: list[tuple[str, str]] = field(default_factory=list)


@dataclass
class SourceTree:
    """Everything found under SRC."""

    root: Path
    layout: str
    classes: list[str]
    splits: list[SplitSource]


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _subdirs(path: Path) -> list[str]:
    return sorted(e.name for e in os.scandir(path) if e.is_dir() and not e.name.startswith("."))


def _walk(root: Path, folder: Path) -> tuple[list[str], int]:
    """Image paths under ``folder`` relative to ``root`` (sorted) and the ignored count."""
    images, ignored = [], 0
    skip = len(str(root)) + 1  # string slicing: Path.relative_to is slow for a million files
    for dirpath, dirnames, filenames in os.walk(folder):
        dirnames.sort()
        relative = Path(dirpath[skip:]).as_posix() if dirpath != str(root) else "."
        for name in sorted(filenames):
            if _is_image(name):
                images.append(name if relative == "." else f"{relative}/{name}")
            elif name not in _METADATA_NAMES:
                ignored += 1
    return images, ignored


def _class_folders(root: Path, folder: Path, name: str, classes: list[str]) -> SplitSource:
    split = SplitSource(name)
    lookup = {c: i for i, c in enumerate(classes)}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.is_dir() and not entry.name.startswith("."):
            if entry.name not in lookup:
                raise ConfigError(f"{folder / entry.name}: class {entry.name!r} is not among the train classes")
            images, ignored = _walk(root, Path(entry.path))
            split.files += [SourceFile(s, lookup[entry.name]) for s in images]
            split.ignored += ignored
        elif not entry.is_dir() and entry.name not in _METADATA_NAMES:
            split.ignored += 1  # files beside the class folders are not samples
    return split


def _metadata_folders(root: Path, data: Path) -> list[Path]:
    """Where ground-truth and synset files are looked for, in order."""
    folders = [data, data / "val", root, data / DEVKIT_DATA, root / DEVKIT_DATA]
    return list(dict.fromkeys(folders))


def _find_file(folders: list[Path], name: str) -> Path | None:
    for folder in folders:
        if (folder / name).is_file():
            return folder / name
    return None


def _kaggle_labels(path: Path) -> dict[str, str]:
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    if not rows or [c.strip() for c in rows[0][:2]] != ["ImageId", "PredictionString"]:
        raise ConfigError(f"{path}: expected a header 'ImageId,PredictionString'")
    return {row[0].strip(): row[1].split()[0] for row in rows[1:] if len(row) >= 2 and row[1].split()}


def _devkit_synsets(folders: list[Path]) -> list[str]:
    """wnids in devkit ILSVRC2012_ID order (index 0 = id 1)."""
    text_file, meta = _find_file(folders, DEVKIT_SYNSETS), _find_file(folders, DEVKIT_META)
    if text_file is not None:
        return [line.split()[0] for line in text_file.read_text().splitlines() if line.strip()]
    if meta is not None:
        from scipy.io import loadmat

        synsets = loadmat(str(meta), squeeze_me=True)["synsets"]
        by_id = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
        return [by_id[i] for i in range(1, 1 + sum(1 for i in by_id if i <= 1000))]
    raise ConfigError(
        f"{DEVKIT_GROUND_TRUTH} holds devkit ids; their synset order is needed from "
        f"{DEVKIT_META} (devkit) or {DEVKIT_SYNSETS} (one wnid per line), in SRC or SRC/val"
    )


def _devkit_labels(path: Path, folders: list[Path]) -> dict[str, str]:
    synsets = _devkit_synsets(folders)
    labels = {}
    for number, line in enumerate(path.read_text().split(), start=1):
        devkit_id = int(line)
        if not 1 <= devkit_id <= len(synsets):
            raise ConfigError(f"{path}: line {number} names devkit id {devkit_id}, outside 1..{len(synsets)}")
        labels[f"ILSVRC2012_val_{number:08d}"] = synsets[devkit_id - 1]
    return labels


def _ground_truth(folders: list[Path]) -> tuple[Path, dict[str, str]]:
    kaggle, devkit = _find_file(folders, KAGGLE_GROUND_TRUTH), _find_file(folders, DEVKIT_GROUND_TRUTH)
    if kaggle is not None:
        return kaggle, _kaggle_labels(kaggle)
    if devkit is not None:
        return devkit, _devkit_labels(devkit, folders)
    raise ConfigError(f"{folders[1]} is flat but neither {KAGGLE_GROUND_TRUTH} nor {DEVKIT_GROUND_TRUTH} is in SRC or SRC/val")


def _flat_val(root: Path, data: Path, classes: list[str]) -> SplitSource:
    path, truth = _ground_truth(_metadata_folders(root, data))
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted({wnid for wnid in truth.values() if wnid not in lookup})
    if unknown:
        raise ConfigError(f"{path} names {len(unknown)} class(es) not in train/, e.g. {unknown[0]!r}")
    images, ignored = _walk(root, data / "val")
    split = SplitSource("val", ignored=ignored)
    for source in images:
        wnid = truth.get(Path(source).name.split(".")[0])
        if wnid is None:
            split.rejects.append((source, f"no label in {path.name}"))
        else:
            split.files.append(SourceFile(source, lookup[wnid]))
    return split


def find_sources(root: Path) -> SourceTree:
    """Discover the layout, classes and samples under ``root``.

    Raises:
        NotFound: ``root`` does not exist or is not a directory.
        ConfigError: no class folders or no image files, or unusable ground truth.
    """
    if not root.is_dir():
        raise NotFound(f"SRC {root} does not exist or is not a directory")
    data = root / KAGGLE_DATA if (root / KAGGLE_DATA / "train").is_dir() else root
    if (data / "train").is_dir():
        tree = SourceTree(root, "ilsvrc", _subdirs(data / "train"), [])
        tree.splits.append(_class_folders(root, data / "train", "train", tree.classes))
        val = data / "val"
        if val.is_dir():
            flat = not _subdirs(val)
            tree.splits.append(_flat_val(root, data, tree.classes) if flat else _class_folders(root, val, "val", tree.classes))
    else:
        tree = SourceTree(root, "folders", _subdirs(root), [])
        tree.splits.append(_class_folders(root, root, "train", tree.classes))
    if not tree.classes:
        raise ConfigError(f"SRC {root} has no class folders")
    if not any(split.files or split.rejects for split in tree.splits):
        raise ConfigError(f"SRC {root} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    return tree
