"""Opening shard directories and reading sample bytes through the index."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import pytest

from core.errors import ConfigError, DataError, NotFound
from shards.reader import ShardDataset
from tests.common.shards import build_sample_shards


def test_bytes_by_index_are_the_tar_members(shards):
    dataset = ShardDataset.open("sample", shards)
    assert set(dataset.splits) == {"train", "val"}
    split = dataset.splits["val"]
    members = {}
    for tar_path in sorted((shards / "val").glob("*.tar")):
        with tarfile.open(tar_path) as tar:
            for member in tar.getmembers():
                members[member.name] = tar.extractfile(member).read()
    for i, key in enumerate(split.keys):
        assert split.read(i).tobytes() == members[f"{key}.jpg"]
        assert int(members[f"{key}.cls"]) == split.labels[i]
    assert [a.tobytes() for a in split.read_many([3, 1])] == [members[f"{split.keys[j]}.jpg"] for j in (3, 1)]


def test_manifest_problems_are_named(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["val"]["num_samples"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="rows, manifest says"):
        ShardDataset.open("x", copy)
    manifest["format_version"] = 99
    (copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match="format_version"):
        ShardDataset.open("x", copy)
    (copy / "manifest.json").write_text("{not json")
    with pytest.raises(DataError, match="manifest"):
        ShardDataset.open("x", copy)
    with pytest.raises(NotFound):
        ShardDataset.open("x", tmp_path / "absent")


def test_missing_index_is_a_data_error(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    (copy / "train" / "index.parquet").unlink()
    with pytest.raises(DataError, match="index"):
        ShardDataset.open("x", copy)


def test_lmdb_only_shards_are_refused_with_the_way_out(tmp_path):
    lmdb_only = build_sample_shards(tmp_path / "lmdb", classes=2, train_per_class=3, val_per_class=1,
                                    formats=("lmdb",))
    with pytest.raises(ConfigError, match="no WebDataset tars.*--format wds"):
        ShardDataset.open("x", lmdb_only)


def _first_in_second_half(split, shard: str) -> int:
    """A sample of ``shard`` whose bytes lie past the middle of the tar."""
    size = (split.root / shard).stat().st_size
    rows = [i for i, key in enumerate(split.keys) if split.shard_of(i) == shard]
    return next(i for i in rows if split.location(i)[0] > size // 2)


def test_a_shard_truncated_while_open_is_a_data_error_naming_shard_and_key(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    split = ShardDataset.open("x", copy).splits["train"]
    shard = split.shard_of(0)
    split.read(0)  # open the shard before it is damaged, as a serving daemon has
    late = _first_in_second_half(split, shard)
    tar = copy / shard
    os.truncate(tar, tar.stat().st_size // 2)
    with pytest.raises(DataError, match=rf"{tar}.*{split.keys[late]}"):
        split.read(late).tobytes()
    with pytest.raises(DataError, match=rf"{split.keys[late]}"):
        split.read_many([late])


def test_a_shard_replaced_by_a_complete_copy_is_reopened(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    split = ShardDataset.open("x", copy).splits["train"]
    shard = split.shard_of(0)
    late = _first_in_second_half(split, shard)
    expected = split.read(late).tobytes()
    tar = copy / shard
    shutil.copyfile(tar, tmp_path / "complete.tar")
    os.truncate(tar, tar.stat().st_size // 2)  # the open file is damaged in place ...
    os.replace(tmp_path / "complete.tar", tar)  # ... and a complete one takes its name
    assert split.read(late).tobytes() == expected
    split.will_need([late, 0])
    assert split.read(0).tobytes() == (ShardDataset.open("y", copy).splits["train"].read(0).tobytes())
