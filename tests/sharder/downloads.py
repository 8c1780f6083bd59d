"""The image-net.org download made from the sample tree, its tree extracted the way
docs/sharding.md says, and what two shard directories must share."""

from __future__ import annotations

import io
import json
import tarfile
from pathlib import Path

from sharder.download_tars import DEVKIT_TAR, TRAIN_TAR, VAL_TAR
from sharder.sample_download import write_download
from tests.common.shards import build_sample_tree

__all__ = ["build_download", "extract_download", "outer_tar", "same_output"]


def build_download(root: Path, **sample: int) -> tuple[Path, Path]:
    """(the sample tree, its image-net.org files) under ``root``."""
    tree = build_sample_tree(root, **sample)
    return tree, write_download(tree, root / f"download-{tree.name}", seed=5)


def extract_download(download: Path, dest: Path) -> Path:
    """The download extracted into ``dest``: train/<wnid>/, flat val/, the devkit."""
    (dest / "train").mkdir(parents=True)
    with tarfile.open(download / TRAIN_TAR) as train:
        train.extractall(dest / "train", filter="data")
    for class_tar in sorted((dest / "train").glob("*.tar")):
        with tarfile.open(class_tar) as tar:
            tar.extractall(class_tar.with_suffix(""), filter="data")
        class_tar.unlink()
    with tarfile.open(download / VAL_TAR) as val:
        val.extractall(dest / "val", filter="data")
    with tarfile.open(download / DEVKIT_TAR) as devkit:
        devkit.extractall(dest, filter="data")
    return dest


def outer_tar(path: Path, members: dict[str, bytes]) -> Path:
    """A tar at ``path`` holding ``members`` (name -> bytes), in that order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        for name, data in members.items():
            tar.addfile(_sized(name, data), io.BytesIO(data))
    return path


def _sized(name: str, data: bytes) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    return info


def same_output(one: Path, other: Path) -> None:
    """Every file of two shard directories is byte-identical, but for the manifest's
    ``source`` (where SRC was)."""
    files = {p.relative_to(one).as_posix(): p.read_bytes() for p in sorted(one.rglob("*")) if p.is_file()}
    others = {p.relative_to(other).as_posix(): p.read_bytes() for p in sorted(other.rglob("*")) if p.is_file()}
    assert sorted(files) == sorted(others)
    assert [name for name in files if name != "manifest.json" and files[name] != others[name]] == []
    manifest, other_manifest = json.loads(files["manifest.json"]), json.loads(others["manifest.json"])
    assert manifest.pop("source") != other_manifest.pop("source")
    assert manifest == other_manifest
