"""Write-then-read: shards made by the sharder, read by readers this project did not
write (stock webdataset, DALI readers.webdataset with the .idx files, DALI
readers.caffe on the LMDB, plain lmdb + tarfile)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from nvidia.dali import fn, pipeline_def, types

from tests.common.shards import build_sample_shards


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("readers"), formats=("wds", "lmdb"))


def _manifest(root: Path) -> dict:
    return json.loads((root / "manifest.json").read_text())


def _index_labels(root: Path, split: str) -> dict[str, int]:
    table = pq.read_table(root / split / "index.parquet")
    return dict(zip(table.column("key").to_pylist(), table.column("label").to_pylist()))


def test_stock_webdataset_decodes_every_image_and_label(shards: Path) -> None:
    manifest = _manifest(shards)
    for split, entry in manifest["splits"].items():
        urls = [str(shards / s["path"]) for s in entry["shards"]]
        samples = list(wds.WebDataset(urls, shardshuffle=False).decode("rgb8"))
        labels = _index_labels(shards, split)
        assert len(samples) == entry["accepted"] == len(labels)
        for sample in samples:
            assert sample["jpg"].ndim == 3 and sample["jpg"].shape[2] == 3
            assert sample["cls"] == labels[sample["__key__"]]


@pipeline_def(batch_size=8, num_threads=1, device_id=None)
def _webdataset_pipe(paths: list[str], index_paths: list[str]):
    jpegs, labels = fn.readers.webdataset(
        paths=paths, index_paths=index_paths, ext=["jpg", "cls"], missing_component_behavior="error", name="reader"
    )
    images = fn.decoders.image(jpegs, device="cpu", output_type=types.RGB)
    return images, labels


def _run_all(pipe, count: int) -> list[tuple[np.ndarray, np.ndarray]]:
    pipe.build()
    out = []
    while len(out) < count:
        images, labels = pipe.run()
        out += [(np.array(images[i]), np.array(labels[i])) for i in range(len(images))]
    return out[:count]


def test_dali_webdataset_reader_uses_the_idx_files(shards: Path) -> None:
    entry = _manifest(shards)["splits"]["train"]
    paths = [str(shards / s["path"]) for s in entry["shards"]]
    index_paths = [str(shards / s["index"]) for s in entry["shards"]]
    samples = _run_all(_webdataset_pipe(paths, index_paths), entry["accepted"])
    table = pq.read_table(shards / "train" / "index.parquet").to_pylist()
    for (image, label_bytes), row in zip(samples, table):  # readers without shuffle keep write order
        assert int(label_bytes.tobytes().decode()) == row["label"]
        assert image.shape == (row["height"], row["width"], 3)


@pipeline_def(batch_size=8, num_threads=1, device_id=None)
def _caffe_pipe(path: str):
    jpegs, labels = fn.readers.caffe(path=path, name="reader")
    return fn.decoders.image(jpegs, device="cpu", output_type=types.RGB), labels


def test_dali_caffe_reader_reads_the_lmdb(shards: Path) -> None:
    entry = _manifest(shards)["splits"]["train"]
    samples = _run_all(_caffe_pipe(str(shards / entry["lmdb"]["path"])), entry["accepted"])
    table = pq.read_table(shards / "train" / "index.parquet").to_pylist()
    assert entry["lmdb"]["samples"] == len(table)
    for (image, label), row in zip(samples, table):  # LMDB key order is write order
        assert int(label.reshape(-1)[0]) == row["label"]
        assert image.shape == (row["height"], row["width"], 3)


def test_index_offsets_slice_the_jpeg_out_of_the_tar(shards: Path) -> None:
    import tarfile

    for row in pq.read_table(shards / "val" / "index.parquet").to_pylist():
        with tarfile.open(shards / row["shard"]) as tar:
            member = tar.extractfile(f"{row['key']}.jpg").read()
        with open(shards / row["shard"], "rb") as f:
            f.seek(row["offset"])
            assert f.read(row["size"]) == member
        assert member[:2] == b"\xff\xd8" and row["source"].startswith("val/")
