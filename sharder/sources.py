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
samples; every other file under a split is ignored and counted. A class folder with
no images stays a class (labels do not shift) and is named in ``empty_classes``.

Each real file is listed once whatever the symbolic links (``sharder.walk``): a link
to a folder already walked, or above one (``ln -s . x``), is skipped and named in
``skipped_links``; a link to a folder elsewhere, such as a class kept on another
disk, is followed. A directory that cannot be listed is a reject with its reason.
"""

from __future__ import annotations

import csv
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError, NotFound
from sharder.config import on_error_policy
from sharder.walk import Listing, TreeWalker, list_dir

__all__ = ["IMAGE_EXTENSIONS", "SourceFile", "SourceTree", "SplitSource", "find_sources"]

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})
KAGGLE_GROUND_TRUTH = "LOC_val_solution.csv"
DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_SYNSETS = "ILSVRC2012_devkit_synsets.txt"
DEVKIT_META = "meta.mat"
DEVKIT_DATA = Path("ILSVRC2012_devkit_t12") / "data"
KAGGLE_DATA = Path("ILSVRC") / "Data" / "CLS-LOC"  # where a Kaggle download keeps train/ and val/
log = logging.getLogger(__name__)
_METADATA_NAMES = {KAGGLE_GROUND_TRUTH, DEVKIT_GROUND_TRUTH, DEVKIT_SYNSETS, DEVKIT_META, "LOC_synset_mapping.txt"}


@dataclass(frozen=True)
class SourceFile:
    """One input sample: ``source`` is its path relative to SRC (POSIX form)."""

    source: str
    label: int


@dataclass
class SplitSource:
    """The inputs of one split, in walk order (class folders sorted, each top-down).

    ``rejects`` and ``skipped_links`` are ``(source, reason)`` pairs; ``empty_classes``
    names the class folders of this split that hold no image file.
    """

    name: str
    files: list[SourceFile] = field(default_factory=list)
    ignored: int = 0
    rejects: list[tuple[str, str]] = field(default_factory=list)
    skipped_links: list[tuple[str, str]] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)


@dataclass
class SourceTree:
    """Everything found under SRC."""

    root: Path
    layout: str
    classes: list[str]
    splits: list[SplitSource]


def _is_image(name: str) -> bool:
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _entries(folder: Path) -> list[os.DirEntry[str]]:
    """The entries of a split folder; without them there is nothing to shard."""
    try:
        return list_dir(folder)
    except OSError as e:
        raise ConfigError(f"cannot list {folder}: {e.strerror or e}") from e


def _subdirs(path: Path) -> list[str]:
    return [e.name for e in _entries(path) if e.is_dir() and not e.name.startswith(".")]


@dataclass
class _Pending:
    """A split whose folders are handed to the walker; made a SplitSource once every
    link is resolved."""

    name: str
    listing: Listing = field(default_factory=Listing)
    class_folders: list[str] = field(default_factory=list)  # relative to SRC, by label
    ignored: int = 0  # files beside the class folders


def _class_folders(walker: TreeWalker, folder: Path, name: str, classes: list[str]) -> _Pending:
    pending = _Pending(name, class_folders=[""] * len(classes))
    lookup = {c: i for i, c in enumerate(classes)}
    walker.claim(folder)
    for entry in _entries(folder):
        if entry.is_dir() and not entry.name.startswith("."):
            if entry.name not in lookup:
                raise ConfigError(f"{folder / entry.name}: class {entry.name!r} is not among the train classes")
            walker.add(pending.listing, Path(entry.path), lookup[entry.name])
            pending.class_folders[lookup[entry.name]] = Path(entry.path).relative_to(walker.root).as_posix()
        elif not entry.is_dir() and entry.name not in _METADATA_NAMES:
            pending.ignored += 1  # files beside the class folders are not samples
    return pending


def _labelled(pending: _Pending, classes: list[str]) -> SplitSource:
    """The split's inputs, labelled by the class folder that holds them."""
    listing = pending.listing
    split = SplitSource(pending.name, ignored=pending.ignored + listing.ignored)
    split.files = [SourceFile(source, label) for source, label in listing.images]
    split.rejects = list(listing.unlisted)
    split.skipped_links = list(listing.skipped_links)
    found = {label for _, label in listing.images}
    split.empty_classes = [c for i, (c, f) in enumerate(zip(classes, pending.class_folders)) if f and i not in found]
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
    raise ConfigError(
        f"{folders[1]} is flat but neither {KAGGLE_GROUND_TRUTH} nor {DEVKIT_GROUND_TRUTH} is in SRC or SRC/val"
    )


def _flat_val(root: Path, data: Path, classes: list[str], pending: _Pending) -> SplitSource:
    path, truth = _ground_truth(_metadata_folders(root, data))
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted({wnid for wnid in truth.values() if wnid not in lookup})
    if unknown:
        raise ConfigError(f"{path} names {len(unknown)} class(es) not in train/, e.g. {unknown[0]!r}")
    listing = pending.listing
    split = SplitSource(
        "val", ignored=listing.ignored, rejects=list(listing.unlisted), skipped_links=list(listing.skipped_links)
    )
    for source, _ in listing.images:
        wnid = truth.get(Path(source).name.split(".")[0])
        if wnid is None:
            split.rejects.append((source, f"no label in {path.name}"))
        else:
            split.files.append(SourceFile(source, lookup[wnid]))
    return split


def _warn(root: Path, split: SplitSource, classes: list[str]) -> None:
    """One line per skipped link and per empty class (the manifest lists them too)."""
    for source, reason in split.skipped_links:
        log.warning("%s: symlink not followed (%s)", root / source, reason)
    for name in split.empty_classes:
        log.warning("%s: class %r has no images in split %s; kept as label %d with 0 samples",
                    root, name, split.name, classes.index(name))


def find_sources(root: Path, on_error: str = "skip") -> SourceTree:
    """Discover the layout, classes and samples under ``root``.

    Args:
        root: SRC.
        on_error: ``"skip"``: a directory that cannot be listed becomes a reject;
            ``"fail"``: it raises ``DataError`` naming it (the old ``"raise"`` still
            works, with a DeprecationWarning).

    Raises:
        NotFound: ``root`` does not exist or is not a directory.
        ConfigError: no class folders or no image files, unusable ground truth, or a
            split folder that cannot be listed.
        DataError: a directory below a split folder cannot be listed (``on_error="fail"``).
    """
    if not root.is_dir():
        raise NotFound(f"SRC {root} does not exist or is not a directory")
    walker = TreeWalker(root, _is_image, _METADATA_NAMES, on_error_policy(on_error))
    data = root / KAGGLE_DATA if (root / KAGGLE_DATA / "train").is_dir() else root
    flat_val: _Pending | None = None
    if (data / "train").is_dir():
        layout, classes = "ilsvrc", _subdirs(data / "train")
        pending = [_class_folders(walker, data / "train", "train", classes)]
        val = data / "val"
        if val.is_dir() and not _subdirs(val):
            flat_val = _Pending("val")
            walker.add(flat_val.listing, val, 0, follow=False)
        elif val.is_dir():
            pending.append(_class_folders(walker, val, "val", classes))
    else:
        layout, classes = "folders", _subdirs(root)
        pending = [_class_folders(walker, root, "train", classes)]
    if not classes:
        raise ConfigError(f"SRC {root} has no class folders")
    walker.finish()
    tree = SourceTree(root, layout, classes, [_labelled(p, classes) for p in pending])
    if flat_val is not None:
        tree.splits.append(_flat_val(root, data, classes, flat_val))
    if not any(split.files or split.rejects for split in tree.splits):
        raise ConfigError(f"SRC {root} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    for split in tree.splits:
        _warn(root, split, classes)
    return tree
