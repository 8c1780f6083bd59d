"""``feeder shard`` of the image-net.org tars themselves (sharder.download_tars):
the shards of their extracted tree, byte for byte; damaged tars and a missing
devkit told in one line naming them, nothing accepted lost."""

from __future__ import annotations

import json
import shutil
import tarfile
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from core.errors import ConfigError, DataError
from sharder import ShardConfig, shard
from sharder.download_tars import DEVKIT_TAR, TRAIN_TAR, VAL_TAR
from sharder.sources import find_sources
from tests.sharder.downloads import build_download, extract_download, outer_tar, same_output
from tests.sharder.odd_files import rgb_jpeg

SHARD_BYTES = 40_000


@pytest.fixture(scope="module")
def download(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the extracted tree, the download) of 3 classes of 8 images and 6 val images."""
    root = tmp_path_factory.mktemp("download")
    _, files = build_download(root, classes=3, train_per_class=8, val_per_class=2)
    return extract_download(files, root / "extracted"), files


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _copy(download: Path, dest: Path, *names: str) -> Path:
    dest.mkdir()
    for name in names:
        shutil.copy(download / name, dest / name)
    return dest


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_the_tars_shard_to_the_bytes_of_their_extracted_tree(
        download: tuple[Path, Path], tmp_path: Path, workers: int) -> None:
    extracted, files = download
    shard(ShardConfig(extracted, tmp_path / "tree", seed=4, shard_size_bytes=SHARD_BYTES))
    report = shard(ShardConfig(files, tmp_path / "tars", seed=4, shard_size_bytes=SHARD_BYTES, workers=workers))
    same_output(tmp_path / "tree", tmp_path / "tars")
    manifest = _manifest(tmp_path / "tars")
    assert manifest["layout"] == "ilsvrc" and [manifest["splits"][s]["accepted"] for s in ("train", "val")] == [24, 6]
    assert report.total("rejected") == 0 and len(manifest["splits"]["train"]["shards"]) > 2
    assert not any(p.suffix == ".JPEG" for p in files.rglob("*"))  # nothing extracted beside them


def test_an_extracted_devkit_beside_the_tars_labels_val_alike(download: tuple[Path, Path], tmp_path: Path) -> None:
    extracted, files = download
    src = _copy(files, tmp_path / "src", TRAIN_TAR, VAL_TAR)
    shutil.copytree(extracted / "ILSVRC2012_devkit_t12", src / "ILSVRC2012_devkit_t12")
    tree, tars = find_sources(extracted), find_sources(src)
    assert [(s.name, s.files) for s in tars.splits] == [(s.name, s.files) for s in tree.splits]
    assert tars.splits[1].reader.shown("val/ILSVRC2012_val_00000001.JPEG") == \
        f"{src / VAL_TAR}/ILSVRC2012_val_00000001.JPEG"


def test_a_truncated_train_tar_is_one_line_naming_it(download: tuple[Path, Path], tmp_path: Path) -> None:
    _, files = download
    src = _copy(files, tmp_path / "src", TRAIN_TAR, VAL_TAR, DEVKIT_TAR)
    whole = (src / TRAIN_TAR).read_bytes()
    (src / TRAIN_TAR).write_bytes(whole[: len(whole) * 2 // 3])  # an incomplete download
    result = CliRunner().invoke(app, ["shard", str(src), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"feeder: error: {src / TRAIN_TAR}: truncated") and "classes after that point" in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_a_train_tar_cut_at_a_member_boundary_is_truncated_too(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    whole = outer_tar(tmp_path / "whole.tar", {"n01.tar": _class_tar(tmp_path, 2), "n02.tar": _class_tar(tmp_path, 2)})
    with tarfile.open(whole) as tar:
        second = tar.getmember("n02.tar")
    (src / TRAIN_TAR).write_bytes(whole.read_bytes()[: second.offset])  # n02.tar missing, no end-of-archive blocks
    with pytest.raises(ConfigError, match=r"truncated: ends after 1 members .* without the end-of-archive"):
        find_sources(src)


def _class_tar(tmp_path: Path, images: int, seed: int = 0) -> bytes:
    path = tmp_path / f"class-{images}-{seed}.tar"
    return outer_tar(path, {f"img_{i}.JPEG": rgb_jpeg(seed + i) for i in range(images)}).read_bytes()


def test_a_class_tar_that_is_not_a_tar_is_a_reject_and_its_class_stays(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    whole = _class_tar(tmp_path, 3, seed=10)
    with tarfile.open(tmp_path / "class-3-10.tar") as tar:
        last = tar.getmembers()[-1]
    damaged = whole[: last.offset_data + last.size // 2]  # its third image cut short: two kept
    outer_tar(src / TRAIN_TAR, {"n01.tar": _class_tar(tmp_path, 2), "n02.tar": b"this is not a tar\n" * 40,
                                "n03.tar": damaged, "README.txt": b"beside the classes"})
    report = shard(ShardConfig(src, tmp_path / "out"))
    split = _manifest(tmp_path / "out")["splits"]["train"]
    assert _manifest(tmp_path / "out")["classes"] == ["n01", "n02", "n03"]  # no label shifts
    assert split["per_class"] == {"n01": 2, "n02": 0, "n03": 2} and split["empty_classes"] == ["n02"]
    assert split["ignored"] == 1 and report.total("rejected") == 2
    reasons = {r["source"]: r["reason"] for r in split["rejects"]}
    assert reasons["train/n02"].startswith("cannot read class tar n02.tar: not a tar file")
    assert reasons["train/n03"].startswith("cannot read class tar n03.tar: truncated: ends inside img_2.JPEG")
    with pytest.raises(DataError, match=rf"{src / TRAIN_TAR}/n02.tar: not a tar file"):
        shard(ShardConfig(src, tmp_path / "failed", on_error="fail"))


def test_val_without_its_devkit_is_one_line_naming_the_val_tar(download: tuple[Path, Path], tmp_path: Path) -> None:
    _, files = download
    src = _copy(files, tmp_path / "src", TRAIN_TAR, VAL_TAR)
    result = CliRunner().invoke(app, ["shard", str(src), str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [
        f"feeder: error: {src / VAL_TAR} is flat but neither LOC_val_solution.csv nor "
        f"ILSVRC2012_validation_ground_truth.txt is in SRC, SRC/ILSVRC2012_devkit_t12/data or {DEVKIT_TAR}"]


def test_a_val_tar_alone_says_what_it_needs(download: tuple[Path, Path], tmp_path: Path) -> None:
    _, files = download
    src = _copy(files, tmp_path / "src", VAL_TAR, DEVKIT_TAR)
    with pytest.raises(ConfigError, match=f"{TRAIN_TAR} must be beside it"):
        find_sources(src)


def test_a_bad_image_inside_a_class_tar_is_named_by_its_place(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    class_tar = outer_tar(tmp_path / "c.tar", {"good.JPEG": rgb_jpeg(1), "cut.JPEG": rgb_jpeg(2)[:300]})
    outer_tar(src / TRAIN_TAR, {"n01.tar": class_tar.read_bytes()})
    shard(ShardConfig(src, tmp_path / "out"))
    (reject,) = _manifest(tmp_path / "out")["splits"]["train"]["rejects"]
    assert reject["source"] == "train/n01/cut.JPEG" and "truncated" in reject["reason"].lower()
    with pytest.raises(DataError, match=rf"^{src / TRAIN_TAR}/n01.tar/cut.JPEG: corrupt image: Truncated"):
        shard(ShardConfig(src, tmp_path / "failed", on_error="fail"))
