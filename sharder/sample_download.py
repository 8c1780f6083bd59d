"""The sample tree (``feeder sample-data``) packed as image-net.org gives ImageNet, to
try ``feeder shard`` on the download itself (the tests and ``bench/shard.py --sources
tars`` do)::

    DEST/ILSVRC2012_img_train.tar      <wnid>.tar per class, each holding its images
    DEST/ILSVRC2012_img_val.tar        ILSVRC2012_val_<8 digits>.JPEG, flat
    DEST/ILSVRC2012_devkit_t12.tar.gz  ILSVRC2012_devkit_t12/data/meta.mat and
                                       .../ILSVRC2012_validation_ground_truth.txt

As in the real devkit, the ground truth holds devkit ids, whose synset order
(``meta.mat``) is not the sorted wnid order: here a seeded permutation of it.
"""

from __future__ import annotations

import csv
import gzip
import io
import tarfile
from pathlib import Path

import numpy as np

from sharder.download_tars import DEVKIT_TAR, TRAIN_TAR, VAL_TAR
from sharder.ground_truth import DEVKIT_DATA, DEVKIT_GROUND_TRUTH, DEVKIT_META, KAGGLE_GROUND_TRUTH

__all__ = ["write_download"]

_MTIME = 1_338_508_800  # 2012-06-01: fixed, so the same tree packs to the same bytes


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, _MTIME, 0o644
    return info


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(_info(name, len(data)), io.BytesIO(data))


def _class_tar(folder: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.GNU_FORMAT) as tar:
        for path in sorted(p for p in folder.iterdir() if p.is_file()):
            _add(tar, path.name, path.read_bytes())
    return buffer.getvalue()


def _meta_mat(order: list[str]) -> bytes:
    from scipy.io import savemat

    synset_type = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")]
    synsets = np.array([(i + 1, wnid, 0) for i, wnid in enumerate(order)], dtype=synset_type)
    buffer = io.BytesIO()
    savemat(buffer, {"synsets": synsets})
    return buffer.getvalue()


def _devkit(tree: Path, classes: list[str], seed: int) -> bytes:
    """The devkit's ``tar.gz``: ground truth in devkit ids, and their synset order."""
    order = [classes[i] for i in np.random.default_rng(seed).permutation(len(classes))]
    devkit_id = {wnid: i + 1 for i, wnid in enumerate(order)}
    with open(tree / KAGGLE_GROUND_TRUTH, newline="") as f:
        truth = {row["ImageId"]: row["PredictionString"].split()[0] for row in csv.DictReader(f)}
    numbers = {int(image_id.rsplit("_", 1)[1]): wnid for image_id, wnid in truth.items()}
    lines = "".join(f"{devkit_id[numbers[n]]}\n" for n in range(1, max(numbers, default=0) + 1))
    buffer = io.BytesIO()
    with gzip.GzipFile(fileobj=buffer, mode="wb", mtime=_MTIME) as packed, \
            tarfile.open(fileobj=packed, mode="w", format=tarfile.GNU_FORMAT) as tar:
        _add(tar, f"{DEVKIT_DATA}/{DEVKIT_META}", _meta_mat(order))
        _add(tar, f"{DEVKIT_DATA}/{DEVKIT_GROUND_TRUTH}", lines.encode())
    return buffer.getvalue()


def write_download(tree: Path, dest: Path, seed: int = 0) -> Path:
    """Pack the sample tree ``tree`` (``train/<wnid>/``, flat ``val/`` and
    ``LOC_val_solution.csv``) into the image-net.org files under ``dest``; returns
    ``dest``. Val images must be numbered from 1 without gaps, as the sample's are."""
    dest.mkdir(parents=True, exist_ok=True)
    classes = sorted(p.name for p in (tree / "train").iterdir() if p.is_dir())
    with tarfile.open(dest / TRAIN_TAR, "w", format=tarfile.GNU_FORMAT) as train:
        for wnid in classes:
            _add(train, f"{wnid}.tar", _class_tar(tree / "train" / wnid))
    if (tree / "val").is_dir():
        with tarfile.open(dest / VAL_TAR, "w", format=tarfile.GNU_FORMAT) as val:
            for path in sorted((tree / "val").iterdir()):
                _add(val, path.name, path.read_bytes())
        (dest / DEVKIT_TAR).write_bytes(_devkit(tree, classes, seed))
    return dest
