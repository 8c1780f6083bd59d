"""Find the samples of a listing of names: an object store prefix, or the members of
the image-net.org tars as the tree they extract to. The layouts and rules are those
of a folder tree (:mod:`sharder.sources`), so the same images give the same sources,
labels and order:

- ``train/<class>/**`` (and ``val/``, in class folders or flat with a ground-truth
  file), also under ``ILSVRC/Data/CLS-LOC/`` (Kaggle); else ``<class>/**``, one split;
- a class folder starting with ``.`` is none; files beside class folders are ignored
  and counted (ground-truth files not counted); inside a class folder, any depth,
  files with an image extension are samples, other files are ignored and counted;
- each split in ``os.walk``'s top-down order of sorted names.

A name ending with ``/`` is a folder of its own (a store's folder marker, a class tar
with no image): a class folder with no images stays a class. There are no links.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from core.errors import ConfigError
from sharder.ground_truth import DEVKIT_DATA, METADATA_NAMES, Found, Lookup, ground_truth, labelled_flat
from sharder.source_reads import Files, Source
from sharder.source_tree import SourceFile, SourceTree, SplitSource, is_image
from sharder.walk import walk_order

__all__ = ["KAGGLE_PREFIX", "Listed", "data_folder", "metadata_folders", "names_lookup", "posix", "tree_of_names"]

KAGGLE_PREFIX = "ILSVRC/Data/CLS-LOC"  # where a Kaggle download keeps train/ and val/


@dataclass
class Listed:
    """What a listing holds, and how to tell its users about it.

    Args:
        root: SRC as messages name it (a URL, a folder).
        names: every file, relative to SRC; names ending with ``/`` are folders.
        reader: reads the files (by these names).
        lookup: finds ground-truth and synset files.
        searched: where ``lookup`` looks, for messages ("SRC or SRC/val").
        flat_val: the flat val/ as messages name it (default ``<root>/val``).
        unlisted: per split, ``(source, reason)`` of what could not be listed (a
            class tar that is not a tar): rejects of that split.
    """

    root: str
    names: Iterable[str]
    reader: Source
    lookup: Lookup
    searched: str = "SRC or SRC/val"
    flat_val: str = ""
    unlisted: dict[str, list[tuple[str, str]]] = field(default_factory=dict)


class _Folders:
    """The files and folders of a listing."""

    def __init__(self, names: Iterable[str]) -> None:
        self.files: list[str] = []
        self.folders: set[str] = {""}
        for name in names:
            if name.endswith("/"):
                self._add_folder(name.rstrip("/"))
            else:
                self.files.append(name)
                self._add_folder(name.rpartition("/")[0])

    def _add_folder(self, folder: str) -> None:
        while folder not in self.folders:
            self.folders.add(folder)
            folder = folder.rpartition("/")[0]

    def subfolders(self, folder: str) -> list[str]:
        """The names of the folders directly in ``folder`` not starting with ``.``, sorted."""
        prefix = f"{folder}/" if folder else ""
        found = {f[len(prefix):] for f in self.folders if f.startswith(prefix) and f != folder}
        return sorted(f for f in found if "/" not in f and not f.startswith("."))

    def under(self, folder: str) -> list[str]:
        """The files below ``folder``, at any depth (relative to it)."""
        prefix = f"{folder}/" if folder else ""
        return [f[len(prefix):] for f in self.files if f.startswith(prefix)]


def _join(folder: str, name: str) -> str:
    return f"{folder}/{name}" if folder else name


def _class_split(listed: Listed, folders: _Folders, folder: str, name: str, classes: list[str]) -> SplitSource:
    lookup = {c: i for i, c in enumerate(classes)}
    present = folders.subfolders(folder)
    for each in present:
        if each not in lookup:
            where = _join(listed.root, _join(folder, each))
            raise ConfigError(f"{where}: class {each!r} is not among the train classes")
    split = SplitSource(name, rejects=list(listed.unlisted.get(name, [])), reader=listed.reader)
    images: list[tuple[str, int]] = []
    for rest in folders.under(folder):
        top, _, inside = rest.partition("/")
        if not inside:
            split.ignored += top not in METADATA_NAMES  # files beside the class folders are not samples
        elif top in lookup:
            if is_image(inside.rpartition("/")[2]):
                images.append((_join(folder, rest), lookup[top]))
            else:
                split.ignored += inside.rpartition("/")[2] not in METADATA_NAMES
    images.sort(key=lambda item: walk_order(item[0]))
    split.files = [SourceFile(source, label) for source, label in images]
    found = {label for _, label in images}
    split.empty_classes = [c for c in present if lookup[c] not in found]
    return split


def _flat_split(listed: Listed, folders: _Folders, folder: str, classes: list[str]) -> SplitSource:
    truth = ground_truth(listed.lookup, listed.flat_val or _join(listed.root, folder), listed.searched)
    images, ignored = [], 0
    for rest in folders.under(folder):
        if is_image(rest.rpartition("/")[2]):
            images.append(_join(folder, rest))
        else:
            ignored += rest.rpartition("/")[2] not in METADATA_NAMES
    files, rejects = labelled_flat(sorted(images, key=walk_order), truth, classes)
    unlisted = list(listed.unlisted.get("val", []))
    return SplitSource("val", files, ignored=ignored, rejects=unlisted + rejects, reader=listed.reader)


def metadata_folders(data: str) -> list[str]:
    """Where ground-truth and synset files are looked for, in order (as for a tree)."""
    folders = [data, _join(data, "val"), "", _join(data, str(DEVKIT_DATA)), str(DEVKIT_DATA)]
    return list(dict.fromkeys(folders))


def names_lookup(files: Files, names: Iterable[str], folders: list[str]) -> Lookup:
    """The first of ``folders`` whose listing (``names``) holds the file, read from ``files``."""
    held = set(names)

    def find(name: str) -> Found | None:
        for folder in folders:
            if _join(folder, name) in held:
                return Found(files.shown(_join(folder, name)), files.read(_join(folder, name)))
        return None

    return find


def data_folder(names: Iterable[str]) -> str:
    """Where train/ and val/ are: the Kaggle download's folder, or SRC itself."""
    prefix = f"{KAGGLE_PREFIX}/train/"
    return KAGGLE_PREFIX if any(name.startswith(prefix) for name in names) else ""


def tree_of_names(listed: Listed, data: str = "") -> SourceTree:
    """The layout, classes and samples of ``listed`` (train/ and val/ under ``data``).

    Raises:
        ConfigError: no class folders, unusable ground truth, a val class that is not
            a train class.
    """
    folders = _Folders(listed.names)
    train = _join(data, "train")
    if train in folders.folders:
        layout, classes = "ilsvrc", folders.subfolders(train)
        splits = [_class_split(listed, folders, train, "train", classes)]
        val = _join(data, "val")
        if val in folders.folders and folders.subfolders(val):
            splits.append(_class_split(listed, folders, val, "val", classes))
        elif val in folders.folders:
            splits.append(_flat_split(listed, folders, val, classes))
    else:
        layout, classes = "folders", folders.subfolders("")
        splits = [_class_split(listed, folders, "", "train", classes)]
    if not classes:
        raise ConfigError(f"SRC {listed.root} has no class folders")
    return SourceTree(listed.root, layout, classes, splits)


def posix(name: str) -> str:
    """A member's name as the path it extracts to (no ``./``, no leading ``/``)."""
    return "/".join(part for part in name.split("/") if part not in ("", "."))
