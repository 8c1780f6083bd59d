"""The labels of a flat ``val/``: which ground-truth file says which class each image
is, wherever that file lies (a folder, an object store, the devkit's ``tar.gz``).

Ground-truth files: ``LOC_val_solution.csv`` (Kaggle; label = first token of
PredictionString) or ``ILSVRC2012_validation_ground_truth.txt`` (devkit; line i holds
the 1-based ILSVRC2012_ID of ``ILSVRC2012_val_<i>``). Devkit ids are *not* sorted-wnid
order: they are mapped through the devkit's own synset order, read from ``meta.mat``
or from ``ILSVRC2012_devkit_synsets.txt`` (one wnid per line, line i = ILSVRC2012_ID i).

Files are found through a :data:`Lookup` (a name -> its first copy), so every layout
reads them with the same code and names them the same way in its rejects.
"""

from __future__ import annotations

import csv
import io
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import NamedTuple

from core.errors import ConfigError
from sharder.source_tree import SourceFile

__all__ = [
    "DEVKIT_DATA", "DEVKIT_GROUND_TRUTH", "DEVKIT_META", "DEVKIT_SYNSETS", "KAGGLE_GROUND_TRUTH", "METADATA_NAMES",
    "Found", "GroundTruth", "Lookup", "chained", "folder_lookup", "ground_truth", "labelled_flat",
]

KAGGLE_GROUND_TRUTH = "LOC_val_solution.csv"
DEVKIT_GROUND_TRUTH = "ILSVRC2012_validation_ground_truth.txt"
DEVKIT_SYNSETS = "ILSVRC2012_devkit_synsets.txt"
DEVKIT_META = "meta.mat"
DEVKIT_DATA = PurePosixPath("ILSVRC2012_devkit_t12") / "data"
# Neither samples nor counted as ignored where they lie beside them.
METADATA_NAMES = frozenset({KAGGLE_GROUND_TRUTH, DEVKIT_GROUND_TRUTH, DEVKIT_SYNSETS, DEVKIT_META,
                            "LOC_synset_mapping.txt"})


class Found(NamedTuple):
    """A metadata file: ``where`` names it in messages (a path, a URL, a member of an
    archive), ``data`` is its content."""

    where: str
    data: bytes


Lookup = Callable[[str], "Found | None"]  # a file name -> its first copy, or None


class GroundTruth(NamedTuple):
    """What a ground-truth file says: image id (``ILSVRC2012_val_00000001``) -> wnid."""

    name: str  # the file's own name, as rejects give it
    where: str
    labels: dict[str, str]


def folder_lookup(folders: list[Path]) -> Lookup:
    """The first of ``folders`` holding a file of the name."""

    def find(name: str) -> Found | None:
        for folder in folders:
            if (folder / name).is_file():
                return Found(str(folder / name), (folder / name).read_bytes())
        return None

    return find


def chained(*lookups: Lookup) -> Lookup:
    """The first of ``lookups`` that finds the name."""

    def find(name: str) -> Found | None:
        return next((found for lookup in lookups if (found := lookup(name)) is not None), None)

    return find


def _kaggle_labels(found: Found) -> dict[str, str]:
    rows = list(csv.reader(io.StringIO(found.data.decode("utf-8", errors="replace"), newline="")))
    if not rows or [c.strip() for c in rows[0][:2]] != ["ImageId", "PredictionString"]:
        raise ConfigError(f"{found.where}: expected a header 'ImageId,PredictionString'")
    return {row[0].strip(): row[1].split()[0] for row in rows[1:] if len(row) >= 2 and row[1].split()}


def _devkit_synsets(lookup: Lookup, searched: str) -> list[str]:
    """wnids in devkit ILSVRC2012_ID order (index 0 = id 1)."""
    text_file = lookup(DEVKIT_SYNSETS)
    if text_file is not None:
        lines = text_file.data.decode("utf-8", errors="replace").splitlines()
        return [line.split()[0] for line in lines if line.strip()]
    meta = lookup(DEVKIT_META)
    if meta is not None:
        from scipy.io import loadmat

        synsets = loadmat(io.BytesIO(meta.data), squeeze_me=True)["synsets"]
        by_id = {int(s["ILSVRC2012_ID"]): str(s["WNID"]) for s in synsets}
        return [by_id[i] for i in range(1, 1 + sum(1 for i in by_id if i <= 1000))]
    raise ConfigError(
        f"{DEVKIT_GROUND_TRUTH} holds devkit ids; their synset order is needed from "
        f"{DEVKIT_META} (devkit) or {DEVKIT_SYNSETS} (one wnid per line), in {searched}"
    )


def _devkit_labels(found: Found, lookup: Lookup, searched: str) -> dict[str, str]:
    synsets = _devkit_synsets(lookup, searched)
    labels = {}
    for number, line in enumerate(found.data.decode("utf-8", errors="replace").split(), start=1):
        devkit_id = int(line)
        if not 1 <= devkit_id <= len(synsets):
            raise ConfigError(f"{found.where}: line {number} names devkit id {devkit_id}, outside 1..{len(synsets)}")
        labels[f"ILSVRC2012_val_{number:08d}"] = synsets[devkit_id - 1]
    return labels


def ground_truth(lookup: Lookup, flat: str, searched: str) -> GroundTruth:
    """The labels of the flat split ``flat`` (named in the error), from Kaggle's file
    if there is one, else the devkit's.

    Raises:
        ConfigError: neither file, devkit ids without their synset order, or a file
            that does not parse (each names ``searched``, where the files were looked for).
    """
    kaggle = lookup(KAGGLE_GROUND_TRUTH)
    if kaggle is not None:
        return GroundTruth(KAGGLE_GROUND_TRUTH, kaggle.where, _kaggle_labels(kaggle))
    devkit = lookup(DEVKIT_GROUND_TRUTH)
    if devkit is not None:
        return GroundTruth(DEVKIT_GROUND_TRUTH, devkit.where, _devkit_labels(devkit, lookup, searched))
    raise ConfigError(f"{flat} is flat but neither {KAGGLE_GROUND_TRUTH} nor {DEVKIT_GROUND_TRUTH} is in {searched}")


def labelled_flat(images: list[str], truth: GroundTruth,
                  classes: list[str]) -> tuple[list[SourceFile], list[tuple[str, str]]]:
    """The images of a flat split labelled by ``truth`` (an image id is the file name
    before its first dot), and the rejects: those it does not name.

    Raises:
        ConfigError: ``truth`` names a class that is not among ``classes``.
    """
    lookup = {c: i for i, c in enumerate(classes)}
    unknown = sorted({wnid for wnid in truth.labels.values() if wnid not in lookup})
    if unknown:
        raise ConfigError(f"{truth.where} names {len(unknown)} class(es) not in train/, e.g. {unknown[0]!r}")
    files, rejects = [], []
    for source in images:
        wnid = truth.labels.get(PurePosixPath(source).name.split(".")[0])
        if wnid is None:
            rejects.append((source, f"no label in {truth.name}"))
        else:
            files.append(SourceFile(source, lookup[wnid]))
    return files, rejects
