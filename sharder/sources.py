"""Find the samples of SRC: which files, which split, which label.

SRC is a folder tree (below), a folder holding the image-net.org tars
(``sharder.download_tars``: read where they lie, nothing extracted), or an object
store prefix holding either (``sharder.store_sources``). Tree layouts:

- ILSVRC2012: ``SRC/train/<class>/**`` and optionally ``SRC/val/``, either in class
  folders or flat with a ground-truth file in SRC or SRC/val. SRC may also be the
  root of a Kaggle download, whose images are in ``ILSVRC/Data/CLS-LOC/{train,val}``
  and whose ``LOC_val_solution.csv`` is at the root. Ground-truth files
  (``sharder.ground_truth``) are looked for in SRC, SRC/val and
  ``ILSVRC2012_devkit_t12/data`` under either.
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

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError, NotFound
from sharder.config import on_error_policy
from sharder.download_tars import download_names, find_download_sources, holds_download
from sharder.ground_truth import DEVKIT_DATA, METADATA_NAMES, folder_lookup, ground_truth, labelled_flat
from sharder.source_reads import FileSource, LocalFiles, Source
from sharder.source_tree import IMAGE_EXTENSIONS, SourceFile, SourceTree, SplitSource, checked, is_image
from sharder.store_sources import find_store_sources
from sharder.walk import Listing, TreeWalker, list_dir
from shards.objects import is_remote
from shards.store import StoreOptions

__all__ = ["IMAGE_EXTENSIONS", "SourceFile", "SourceTree", "SplitSource", "find_sources"]

KAGGLE_DATA = Path("ILSVRC") / "Data" / "CLS-LOC"  # where a Kaggle download keeps train/ and val/
log = logging.getLogger(__name__)


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
        elif not entry.is_dir() and entry.name not in METADATA_NAMES:
            pending.ignored += 1  # files beside the class folders are not samples
    return pending


def _labelled(pending: _Pending, classes: list[str], reader: Source) -> SplitSource:
    """The split's inputs, labelled by the class folder that holds them."""
    listing = pending.listing
    split = SplitSource(pending.name, ignored=pending.ignored + listing.ignored, reader=reader)
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


def _flat_val(root: Path, data: Path, classes: list[str], pending: _Pending, reader: Source) -> SplitSource:
    truth = ground_truth(folder_lookup(_metadata_folders(root, data)), str(data / "val"), "SRC or SRC/val")
    listing = pending.listing
    files, rejects = labelled_flat([source for source, _ in listing.images], truth, classes)
    return SplitSource("val", files, ignored=listing.ignored, rejects=list(listing.unlisted) + rejects,
                       skipped_links=list(listing.skipped_links), reader=reader)


def find_sources(root: Path | str, on_error: str = "skip", store_options: StoreOptions | None = None) -> SourceTree:
    """Discover the layout, classes and samples of SRC.

    Args:
        root: SRC: a folder tree, a folder holding the image-net.org tars
            (``sharder.download_tars``), or the URL of an object store prefix holding
            either (``sharder.store_sources``).
        on_error: ``"skip"``: a directory that cannot be listed (a class tar that
            cannot be read) becomes a reject; ``"fail"``: it raises ``DataError``
            naming it.
        store_options: how a store SRC is talked to (endpoint, timeouts).

    Raises:
        NotFound: ``root`` does not exist or is not a directory.
        ConfigError: no class folders or no image files, unusable ground truth, a
            split folder that cannot be listed, or a damaged train tar.
        DataError: a directory below a split folder (a class tar) cannot be listed
            (``on_error="fail"``).
        StoreRefused, StoreUnreachable: a store SRC cannot be listed.
    """
    on_error = on_error_policy(on_error)
    if isinstance(root, str) and is_remote(root):
        return find_store_sources(root, on_error, store_options or StoreOptions())
    root = Path(root)
    if not root.is_dir():
        raise NotFound(f"SRC {root} does not exist or is not a directory")
    if holds_download(root):
        return find_download_sources(LocalFiles(root), set(download_names(root)), on_error)
    return checked(_find_tree_sources(root, on_error))


def _find_tree_sources(root: Path, on_error: str) -> SourceTree:
    reader = FileSource(LocalFiles(root))
    walker = TreeWalker(root, is_image, METADATA_NAMES, on_error)
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
    tree = SourceTree(root, layout, classes, [_labelled(p, classes, reader) for p in pending])
    if flat_val is not None:
        tree.splits.append(_flat_val(root, data, classes, flat_val, reader))
    return tree
