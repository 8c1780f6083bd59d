"""The image-net.org download read where it lies, nothing extracted.

SRC is a folder (or a store prefix) holding the files image-net.org gives:

- ``ILSVRC2012_img_train.tar``: a tar of 1,000 class tars ``n01440764.tar``, each
  holding ``n01440764_10026.JPEG`` ...;
- ``ILSVRC2012_img_val.tar`` (optional): flat ``ILSVRC2012_val_00000001.JPEG`` ...,
  labelled by the devkit's ground truth: ``ILSVRC2012_devkit_t12.tar.gz`` beside it,
  or the devkit extracted there (``ILSVRC2012_devkit_t12/data/``), or any of the
  ground-truth files a tree takes (``sharder.ground_truth``) in SRC.

The tars are indexed once: the outer tar's member headers give each class tar's
offset, each class tar's headers its images' offsets (tar headers are read with a
seek each; no image byte is read), so that every image is then read with one
``pread`` (or one ranged GET) at outer offset + inner offset. Images are named as
the extracted tree names them (``train/n01440764/n01440764_10026.JPEG``,
``val/ILSVRC2012_val_00000001.JPEG``), so sharding the tars gives the manifest, index
and shards of sharding their extracted tree with the same seed.

Damage: an outer tar that ends early (an incomplete download) or holds a damaged
header stops the run whatever ``--on-error`` says, naming the tar: past that point
classes would be missing and every label after them would shift. A class tar that
is not a tar, or is damaged inside a whole outer tar, is like a folder that cannot be
listed: a reject of the train split (its class kept, with the images before the
damage), or with ``--on-error fail`` the end of the run naming it.
"""

from __future__ import annotations

import io
import tarfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from core.errors import ConfigError, DataError
from sharder.ground_truth import DEVKIT_DATA, Found, Lookup, chained
from sharder.names_tree import Listed, names_lookup, posix, tree_of_names
from sharder.source_reads import Files, Member, TarMemberSource
from sharder.source_tree import SourceTree, checked, is_image
from sharder.tar_members import Entry, TarDamaged, TarWindow, tar_entries

__all__ = ["DEVKIT_TAR", "TRAIN_TAR", "VAL_TAR", "download_names", "find_download_sources", "holds_download"]

TRAIN_TAR = "ILSVRC2012_img_train.tar"
VAL_TAR = "ILSVRC2012_img_val.tar"
DEVKIT_TAR = "ILSVRC2012_devkit_t12.tar.gz"
_INDEX_THREADS = 8  # class tars indexed at once from a store: its round trips overlap (locally: one,
# as parsing headers holds the GIL and threads only add their switches: 10 class tars took 0.12 s in 8, 0.03 in 1)


def holds_download(root: Path) -> bool:
    """Whether the folder ``root`` is the image-net.org download (its tars, no train/)."""
    return ((root / TRAIN_TAR).is_file() or (root / VAL_TAR).is_file()) and not (root / "train").is_dir()


def download_names(root: Path) -> list[str]:
    """The files at the top of ``root`` and in its extracted devkit's data folder."""
    names = [p.name for p in root.iterdir() if p.is_file()]
    devkit = root / DEVKIT_DATA
    return names + ([f"{DEVKIT_DATA}/{p.name}" for p in devkit.iterdir() if p.is_file()] if devkit.is_dir() else [])


class _Index:
    """The names (as extracted) and members found in the download's tars."""

    def __init__(self, files: Files, on_error: str) -> None:
        self.files, self.on_error = files, on_error
        self.names: list[str] = []
        self.members: dict[str, Member] = {}
        self.rejects: dict[str, list[tuple[str, str]]] = {"train": [], "val": []}

    def add(self, folder: str, entry: Entry, tar: str, start: int, inside: str) -> None:
        """One member of a class tar (or of the val tar) under ``folder``."""
        source = f"{folder}/{posix(entry.name)}"
        if entry.kind == "dir":
            self.names.append(source + "/")
        elif entry.kind == "file":
            self.names.append(source)
            self.members[source] = Member(tar, start + entry.offset, entry.size, f"{inside}{posix(entry.name)}")
        elif is_image(entry.name):
            self.rejects[folder.partition("/")[0]].append(
                (source, "a link or special file in the tar, not an image's bytes"))

    def outer(self, tar: str, what: str) -> list[Entry]:
        """The members of the outer tar ``tar``.

        Raises:
            ConfigError: it is damaged or ends early (names it).
        """
        try:
            return tar_entries(TarWindow(self.files, tar, 0, self.files.size(tar)))
        except TarDamaged as e:
            raise ConfigError(f"{self.files.shown(tar)}: {e.reason}; {what} cannot be read past it") from e

    def class_tar(self, wnid: str, outer: Entry) -> list[Entry]:
        """The members of one class tar, or those before its damage (and a reject)."""
        try:
            return tar_entries(TarWindow(self.files, TRAIN_TAR, outer.offset, outer.size))
        except TarDamaged as e:
            shown = f"{self.files.shown(TRAIN_TAR)}/{posix(outer.name)}"
            if self.on_error == "fail":
                raise DataError(f"{shown}: {e.reason}") from e
            self.rejects["train"].append((f"train/{wnid}", f"cannot read class tar {posix(outer.name)}: {e.reason}"))
            return e.entries


def _index_train(index: _Index) -> None:
    classes: list[tuple[str, Entry]] = []
    index.names.append("train/")
    for entry in index.outer(TRAIN_TAR, "the classes after that point"):
        name = posix(entry.name)
        if entry.kind == "file" and "/" not in name and name.endswith(".tar"):
            classes.append((name.removesuffix(".tar"), entry))
            index.names.append(f"train/{name.removesuffix('.tar')}/")  # a class, even when it holds no image
        elif entry.kind == "file":
            index.names.append(f"train/{name}")  # beside the class tars: ignored, and counted
    threads = _INDEX_THREADS if index.files.latency_bound else 1
    with ThreadPoolExecutor(threads, thread_name_prefix="index-tar") as pool:
        listed = list(pool.map(lambda c: index.class_tar(*c), classes))
    for (wnid, outer), members in zip(classes, listed):
        for member in members:
            index.add(f"train/{wnid}", member, TRAIN_TAR, outer.offset, f"{posix(outer.name)}/")


def _devkit_files(files: Files) -> dict[str, bytes]:
    """The files of the devkit's data folder in its ``tar.gz``, by path.

    Raises:
        ConfigError: it is not a readable ``tar.gz``.
    """
    try:
        with tarfile.open(fileobj=io.BytesIO(files.read(DEVKIT_TAR)), mode="r:gz") as tar:
            wanted = [m for m in tar if m.isreg() and posix(m.name).startswith(f"{DEVKIT_DATA}/")]
            return {posix(m.name): tar.extractfile(m).read() for m in wanted}  # type: ignore[union-attr]
    except (tarfile.TarError, OSError, EOFError) as e:
        raise ConfigError(f"{files.shown(DEVKIT_TAR)}: not the devkit's tar.gz ({e})") from e


def _devkit_lookup(files: Files, names: set[str]) -> Lookup:
    """Files of the devkit's ``tar.gz`` (read once, when first asked for), by their
    name in its data folder."""
    opened: list[dict[str, bytes]] = []  # its data files, once read

    def find(name: str) -> Found | None:
        if DEVKIT_TAR not in names:
            return None
        if not opened:
            opened.append(_devkit_files(files))
        data = opened[0].get(f"{DEVKIT_DATA}/{name}")
        return None if data is None else Found(f"{files.shown(DEVKIT_TAR)}/{DEVKIT_DATA}/{name}", data)

    return find


def find_download_sources(files: Files, names: set[str], on_error: str) -> SourceTree:
    """The classes and samples of the image-net.org tars under ``files`` (``names``:
    the files there, for the ground truth).

    Raises:
        ConfigError: no train tar, a damaged or truncated outer tar, no class tar, or
            no usable ground truth for the val tar.
        DataError: a class tar that cannot be read (``on_error="fail"``).
    """
    if TRAIN_TAR not in names:
        raise ConfigError(f"{files.shown(VAL_TAR)}: {TRAIN_TAR} must be beside it (its class tars are the classes)")
    index = _Index(files, on_error)
    _index_train(index)
    if not any(name.count("/") == 2 and name.endswith("/") for name in index.names):
        raise ConfigError(f"{files.shown(TRAIN_TAR)}: holds no class tars (<wnid>.tar)")
    if VAL_TAR in names:
        index.names.append("val/")
        for entry in index.outer(VAL_TAR, "the images after that point"):
            index.add("val", entry, VAL_TAR, 0, "")
    lookup = chained(names_lookup(files, names, ["", str(DEVKIT_DATA)]), _devkit_lookup(files, names))
    listed = Listed(files.shown(""), index.names, TarMemberSource(files, index.members), lookup,
                    searched=f"SRC, SRC/{DEVKIT_DATA} or {DEVKIT_TAR}", flat_val=files.shown(VAL_TAR),
                    unlisted=index.rejects)
    return checked(tree_of_names(listed))
