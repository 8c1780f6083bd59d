"""sharder.shard end to end: layouts, odd files, counts, shard sizes, formats."""

from __future__ import annotations

import csv
import json
import tarfile
from pathlib import Path

import cv2
import numpy as np
import pyarrow.parquet as pq
import pytest

from core.errors import ConfigError, DataError, NotFound
from sharder import ShardConfig, shard
from sharder.verify import verify
from shards.reader import ShardDataset
from tests.common.shards import build_sample_tree
from tests.sharder.odd_files import (
    corrupt_scan_jpeg,
    forged_size_jpeg,
    huge_jpeg,
    make_unlistable,
    odd_inputs,
    rgb_jpeg,
    write_tree,
)


def _manifest(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())


def _rows(out: Path, split: str) -> list[dict]:
    return pq.read_table(out / split / "index.parquet").to_pylist()


def _member(out: Path, row: dict) -> bytes:
    with tarfile.open(out / row["shard"]) as tar:
        return tar.extractfile(f"{row['key']}.jpg").read()


def _pixels(data: bytes) -> np.ndarray:
    return cv2.imdecode(np.frombuffer(data, np.uint8), cv2.IMREAD_COLOR)


@pytest.fixture
def odd_tree(tmp_path: Path) -> Path:
    odd = {name: data for name, (data, _) in odd_inputs().items()}
    good = {f"img{i}.jpg": rgb_jpeg(10 + i) for i in range(5)}
    tree = write_tree(tmp_path / "src", {"zebra": odd, "apple": good})
    (tree / "apple" / "README.txt").write_text("not a sample")
    (tree / "zebra" / ".DS_Store").write_bytes(b"\0\1")
    return tree


def test_plain_tree_normalises_rejects_and_counts_everything(odd_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    report = shard(ShardConfig(odd_tree, out, seed=3))
    manifest, expected = _manifest(out), odd_inputs()
    assert manifest["classes"] == ["apple", "zebra"] and list(manifest["splits"]) == ["train"]
    split = manifest["splits"]["train"]
    rejected = {f"zebra/{n}" for n, (_, outcome) in expected.items() if outcome == "reject"}
    assert {r["source"] for r in split["rejects"]} == rejected and all(r["reason"] for r in split["rejects"])
    assert split["ignored"] == 2 and split["rejected"] == len(rejected)
    assert split["reencoded"] == sum(outcome == "reencode" for _, outcome in expected.values())
    assert split["accepted"] + split["rejected"] == split["inputs"] == len(expected) + 5
    assert split["per_class"] == {"apple": 5, "zebra": len(expected) - len(rejected)}
    for row in _rows(out, "train"):
        name = Path(row["source"]).name
        assert row["label"] == (0 if row["source"].startswith("apple/") else 1)
        stored = _member(out, row)
        original = (odd_tree / row["source"]).read_bytes()
        if row["source"].startswith("apple/") or expected[name][1] == "pass":
            # Rewritten with restart markers, losslessly: the same pixels.
            assert _pixels(stored).tobytes() == _pixels(original).tobytes()
            assert b"\xff\xdd" in stored[: stored.index(b"\xff\xda")], "a DRI segment"
        else:
            assert stored[:2] == b"\xff\xd8" and stored != original
    assert f"rejected {len(rejected)}, re-encoded {split['reencoded']}, ignored 2" in report.summary()
    assert not verify(out, full=True).problems


def test_restart_interval_0_stores_jpegs_byte_for_byte(odd_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    shard(ShardConfig(odd_tree, out, seed=3, restart_interval=0))
    assert _manifest(out)["options"]["restart_interval"] == 0
    expected = odd_inputs()
    passed = [r for r in _rows(out, "train")
              if r["source"].startswith("apple/") or expected[Path(r["source"]).name][1] == "pass"]
    assert passed
    for row in passed:
        assert _member(out, row) == (odd_tree / row["source"]).read_bytes()


def test_on_error_fail_stops_at_the_first_bad_file(odd_tree: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"zebra/.*: "):
        shard(ShardConfig(odd_tree, tmp_path / "out", on_error="fail"))


def test_kaggle_val_labels_follow_loc_val_solution(tmp_path: Path) -> None:
    src = build_sample_tree(tmp_path, classes=3, train_per_class=4, val_per_class=3)
    (src / "val" / "ILSVRC2012_val_00000099.JPEG").write_bytes(rgb_jpeg())  # not in the csv
    out = tmp_path / "out"
    shard(ShardConfig(src, out))
    classes = _manifest(out)["classes"]
    rejects = _manifest(out)["splits"]["val"]["rejects"]
    assert rejects == [{"source": "val/ILSVRC2012_val_00000099.JPEG", "reason": "no label in LOC_val_solution.csv"}]
    with open(src / "LOC_val_solution.csv", newline="") as f:
        truth = {row["ImageId"]: row["PredictionString"].split()[0] for row in csv.DictReader(f)}
    rows = _rows(out, "val")
    assert len(rows) == 9 == len(truth)
    for row in rows:
        assert classes[row["label"]] == truth[Path(row["source"]).stem]


def test_kaggle_download_root_is_understood(tmp_path: Path) -> None:
    sample = build_sample_tree(tmp_path, classes=2, train_per_class=3, val_per_class=2)
    kaggle = tmp_path / "imagenet-object-localization-challenge"
    (kaggle / "ILSVRC" / "Data").mkdir(parents=True)
    (sample / "LOC_val_solution.csv").rename(kaggle / "LOC_val_solution.csv")
    sample.rename(kaggle / "ILSVRC" / "Data" / "CLS-LOC")
    out = tmp_path / "out"
    shard(ShardConfig(kaggle, out))
    manifest = _manifest(out)
    assert manifest["layout"] == "ilsvrc" and manifest["classes"] == ["n00000001", "n00000002"]
    assert [manifest["splits"][s]["accepted"] for s in ("train", "val")] == [6, 4]
    assert all(r["source"].startswith("ILSVRC/Data/CLS-LOC/val/") for r in _rows(out, "val"))


def _devkit_tree(root: Path, synset_order: list[str], ids: list[int]) -> Path:
    write_tree(root, {f"train/{w}": {f"{w}_1.JPEG": rgb_jpeg(i)} for i, w in enumerate(synset_order)})
    names = {f"val/ILSVRC2012_val_{n:08d}.JPEG": rgb_jpeg(20 + n) for n in range(1, len(ids) + 1)}
    write_tree(root, {".": names})
    (root / "ILSVRC2012_validation_ground_truth.txt").write_text("".join(f"{i}\n" for i in ids))
    return root


def test_devkit_ids_map_through_the_devkit_synset_order(tmp_path: Path) -> None:
    order = ["n03000000", "n01000000", "n02000000"]  # devkit order is not sorted order
    src = _devkit_tree(tmp_path / "src", order, ids=[1, 2, 3, 1])
    (src / "val" / "ILSVRC2012_devkit_synsets.txt").write_text("".join(f"{w} name\n" for w in order))
    shard(ShardConfig(src, tmp_path / "out"))
    labels = {Path(r["source"]).stem: r["label"] for r in _rows(tmp_path / "out", "val")}
    sorted_index = {w: i for i, w in enumerate(sorted(order))}
    assert labels == {f"ILSVRC2012_val_{n:08d}": sorted_index[order[i - 1]] for n, i in enumerate([1, 2, 3, 1], 1)}


def test_devkit_meta_mat_gives_the_synset_order(tmp_path: Path) -> None:
    import numpy as np
    from scipy.io import savemat

    order = ["n02000000", "n01000000"]
    src = _devkit_tree(tmp_path / "src", order, ids=[2, 1])
    synset_type = [("ILSVRC2012_ID", "O"), ("WNID", "O"), ("num_children", "O")]
    synsets = np.array([(i + 1, w, 0) for i, w in enumerate(order)], dtype=synset_type)
    (src / "ILSVRC2012_devkit_t12" / "data").mkdir(parents=True)
    savemat(src / "ILSVRC2012_devkit_t12" / "data" / "meta.mat", {"synsets": synsets})
    shard(ShardConfig(src, tmp_path / "out"))
    labels = {Path(r["source"]).stem: r["label"] for r in _rows(tmp_path / "out", "val")}
    assert labels == {"ILSVRC2012_val_00000001": 0, "ILSVRC2012_val_00000002": 1}


def test_devkit_ground_truth_without_synset_order_is_an_error(tmp_path: Path) -> None:
    src = _devkit_tree(tmp_path / "src", ["n01000000"], ids=[1])
    with pytest.raises(ConfigError, match="synset order"):
        shard(ShardConfig(src, tmp_path / "out"))


def test_ground_truth_naming_an_unknown_class_is_an_error(tmp_path: Path) -> None:
    src = build_sample_tree(tmp_path, classes=2, train_per_class=1, val_per_class=1)
    csv_path = src / "LOC_val_solution.csv"
    csv_path.write_text(csv_path.read_text().replace("n00000002", "n99999999"))
    with pytest.raises(ConfigError, match="n99999999"):
        shard(ShardConfig(src, tmp_path / "out"))


def test_val_in_class_folders(tmp_path: Path) -> None:
    tree = {f"{s}/{c}": {f"{c}_{s}.jpg": rgb_jpeg(i)} for i, c in enumerate("ab") for s in ("train", "val")}
    src = write_tree(tmp_path / "src", tree)
    shard(ShardConfig(src, tmp_path / "out"))
    assert [(r["source"], r["label"]) for r in sorted(_rows(tmp_path / "out", "val"), key=lambda r: r["label"])] == [
        ("val/a/a_val.jpg", 0),
        ("val/b/b_val.jpg", 1),
    ]


def test_small_shard_size_rolls_into_several_tars(tmp_path: Path) -> None:
    src = build_sample_tree(tmp_path, classes=3, train_per_class=10, val_per_class=1)
    out = tmp_path / "out"
    shard(ShardConfig(src, out, shard_size_bytes=40_000))
    shards = _manifest(out)["splits"]["train"]["shards"]
    assert len(shards) > 3
    assert all(s["bytes"] <= 40_000 and (out / s["path"]).stat().st_size == s["bytes"] for s in shards)
    assert sum(s["samples"] for s in shards) == 30


def test_shuffle_mixes_classes_and_depends_on_the_seed(tmp_path: Path) -> None:
    src = build_sample_tree(tmp_path, classes=3, train_per_class=10, val_per_class=1)
    shard(ShardConfig(src, tmp_path / "a", seed=1))
    shard(ShardConfig(src, tmp_path / "b", seed=2))
    a, b = ([r["source"] for r in _rows(tmp_path / x, "train")] for x in "ab")
    assert sorted(a) == sorted(b) and a != b and a != sorted(a)


def test_lmdb_only_format_indexes_the_lmdb(tmp_path: Path) -> None:
    src = build_sample_tree(tmp_path, classes=2, train_per_class=3, val_per_class=1)
    out = tmp_path / "out"
    shard(ShardConfig(src, out, formats=("lmdb",)))
    split = _manifest(out)["splits"]["train"]
    assert split["shards"] == [] and split["lmdb"]["samples"] == 6
    assert not list(out.rglob("*.tar")) and not (out / ".work").exists()
    assert {r["shard"] for r in _rows(out, "train")} == {"train/lmdb"}
    result = verify(out, full=True)
    assert not result.problems and result.decoded == 8


def test_missing_src_and_src_without_images(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="does not exist"):
        shard(ShardConfig(tmp_path / "nowhere", tmp_path / "out"))
    write_tree(tmp_path / "empty", {"a": {"notes.txt": b"x"}})
    with pytest.raises(ConfigError, match="no image files"):
        shard(ShardConfig(tmp_path / "empty", tmp_path / "out"))


def test_non_empty_out_needs_overwrite(odd_tree: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    with pytest.raises(ConfigError, match="not empty"):
        shard(ShardConfig(odd_tree, out))
    shard(ShardConfig(odd_tree, out, overwrite=True))
    assert not (out / "keep.txt").exists() and (out / "manifest.json").is_file()


def test_worker_processes_give_the_same_bytes_for_odd_files(odd_tree: Path, tmp_path: Path) -> None:
    one, two = tmp_path / "one", tmp_path / "two"
    shard(ShardConfig(odd_tree, one, max_side_px=32))
    shard(ShardConfig(odd_tree, two, max_side_px=32, workers=2))
    files = sorted(p.relative_to(one) for p in one.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(two) for p in two.rglob("*") if p.is_file())
    assert all((one / f).read_bytes() == (two / f).read_bytes() for f in files)
    assert all(max(r["width"], r["height"]) <= 32 for r in _rows(two, "train"))


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_decode_check_rejects_corrupt_scan_data_and_bombs_on_the_workers(tmp_path: Path, workers: int) -> None:
    good = {f"img{i}.jpg": rgb_jpeg(20 + i) for i in range(4)}
    bad = {"corrupt_scan.jpg": corrupt_scan_jpeg(), "bomb.jpg": huge_jpeg()}
    src = write_tree(tmp_path / "src", {"a": good, "b": bad | {"ok.jpg": rgb_jpeg(30)}})
    shard(ShardConfig(src, tmp_path / "out", workers=workers))
    reasons = {r["source"]: r["reason"] for r in _manifest(tmp_path / "out")["splits"]["train"]["rejects"]}
    assert set(reasons) == {"b/corrupt_scan.jpg", "b/bomb.jpg"}, reasons
    assert "corrupt" in reasons["b/corrupt_scan.jpg"] and "--max-pixels" in reasons["b/bomb.jpg"]
    header_only = shard(ShardConfig(src, tmp_path / "header", check="header"))
    assert header_only.total("rejected") == 1  # the corrupt scan passes a header check
    downscaled = shard(ShardConfig(src, tmp_path / "small", max_side_px=256))
    assert downscaled.total("rejected") == 1 and downscaled.total("accepted") == 6
    assert not verify(tmp_path / "small", full=True).problems


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_downscaling_decodes_every_image_it_stores(tmp_path: Path, workers: int) -> None:
    good = {f"img{i}.jpg": rgb_jpeg(20 + i) for i in range(4)}
    forged = {"forged.jpg": forged_size_jpeg(65000), "ok.jpg": rgb_jpeg(30)}
    src = write_tree(tmp_path / "src", {"a": good, "b": forged})
    out = tmp_path / "out"
    report = shard(ShardConfig(src, out, max_side_px=128, workers=workers))
    reasons = {r["source"]: r["reason"] for r in _manifest(out)["splits"]["train"]["rejects"]}
    assert list(reasons) == ["b/forged.jpg"] and reasons["b/forged.jpg"].startswith("corrupt image: decoder reports")
    assert report.total("rejected") == 1 and report.total("accepted") == 5
    assert "b/forged.jpg" not in {row["source"] for row in _rows(out, "train")}
    assert not verify(out, full=True).problems


def test_manifest_names_skipped_links_empty_classes_and_unlistable_folders(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = write_tree(
        tmp_path / "src",
        {"apple": {"a0.jpg": rgb_jpeg(0)}, "apple/sub": {"a1.jpg": rgb_jpeg(1)}, "zebra": {"z0.jpg": rgb_jpeg(2)}},
    )
    (src / "mango").mkdir()
    (src / "x").symlink_to(".")
    make_unlistable(monkeypatch, src / "apple" / "sub")
    out = tmp_path / "out"
    report = shard(ShardConfig(src, out))
    manifest = _manifest(out)
    split = manifest["splits"]["train"]
    assert manifest["format_version"] == 1 and manifest["classes"] == ["apple", "mango", "x", "zebra"]
    assert split["per_class"] == {"apple": 1, "mango": 0, "x": 0, "zebra": 1}
    assert split["empty_classes"] == ["mango", "x"]
    assert [link["source"] for link in split["skipped_links"]] == ["x"] and split["skipped_links"][0]["reason"]
    assert {"source": "apple/sub", "reason": "cannot list directory: Permission denied"} in split["rejects"]
    assert split["rejected"] == 1 and split["accepted"] == 2
    summary = report.summary()
    assert "rejected 1," in summary and "skipped 1 link" in summary and "2 empty classes" in summary
    assert not verify(out).problems
    assert ShardDataset.open("fruit", out).classes == manifest["classes"]  # the one reader tolerates the new keys


@pytest.mark.slow
def test_the_bytes_are_the_same_whatever_the_workers_and_whoever_processed_each_run(tmp_path: Path) -> None:
    # Enough inputs for every worker's tasks and the writing process's own runs to
    # interleave (runs of 16, 4 tasks a worker at hand).
    images = {f"c{c}": {f"img{i}.jpg": rgb_jpeg(16 + (c * 7 + i) % 40) for i in range(60)} for c in range(4)}
    src = write_tree(tmp_path / "src", images)
    outs = [tmp_path / f"w{workers}" for workers in (1, 2, 3)]
    for workers, out in zip((1, 2, 3), outs):
        shard(ShardConfig(src, out, workers=workers, shard_size_bytes=64 << 10))
    files = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert len([f for f in files if f.suffix == ".tar"]) > 2
    for out in outs[1:]:
        assert files == sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
        assert all((outs[0] / f).read_bytes() == (out / f).read_bytes() for f in files), out
