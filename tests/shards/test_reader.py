"""Opening shard directories and reading sample bytes through the index."""

from __future__ import annotations

import json
import os
import shutil
import tarfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from core.errors import ConfigError, DataError, NotFound, SampleCorrupt
from shards.index import read_index
from shards.layout import CHECKSUM_COLUMNS, INDEX_VERSION_KEY, index_path, sample_checksum
from shards.reader import ShardDataset
from tests.common.shards import build_sample_shards, seal_index


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


@pytest.mark.slow
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
    with pytest.raises(ConfigError, match="no WebDataset tars.*--formats lmdb only.*--formats wds"):
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


def _overwrite(path: Path, offset: int, data: bytes) -> None:
    """Write ``data`` over the bytes of ``path`` at ``offset``, in place (same inode,
    same size: ``dd conv=notrunc``, ``rsync --inplace``)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_every_sample_is_read_against_its_checksum_in_the_index(shards):
    split = ShardDataset.open("x", shards).splits["val"]
    table = read_index(shards, "val")
    assert table.column("checksum").to_pylist() == [sample_checksum(split.read(i)) for i in range(len(split))]
    assert table.column("half_checksum").to_pylist() == [0] * len(split)  # no copies


def test_bytes_changed_in_place_are_refused_naming_tar_and_key_until_restored(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    split = ShardDataset.open("x", copy).splits["train"]
    row = 5
    original = split.read(row).tobytes()  # the tar is open, as a serving daemon has it
    tar, (offset, size) = copy / split.shard_of(row), split.location(row)
    other = next(i for i in range(len(split)) if split.location(i)[1] >= size and i != row)
    _overwrite(tar, offset, split.read(other).tobytes()[:size])  # another image's bytes, same size
    with pytest.raises(SampleCorrupt, match=rf"^{tar}: sample {split.keys[row]} differs from its checksum") as caught:
        split.read(row)
    with pytest.raises(SampleCorrupt):  # opening reads no sample (start-up stays fast): the read finds it
        ShardDataset.open("y", copy).splits["train"].read(row)
    error = caught.value
    assert (error.path, error.key, error.index, error.half) == (tar, split.keys[row], row, False)
    with pytest.raises(SampleCorrupt, match=split.keys[row]):
        split.read_many([other, row])
    with pytest.raises(SampleCorrupt, match=split.keys[row]):
        split.read_windows([row], np.array([[0, 0, 8, 8]]), 16)
    split.read(other)  # the other samples still read

    _overwrite(tar, offset, original)  # the right bytes again: read as they are, no reopening
    assert split.read(row).tobytes() == original
    assert split.read_many([row])[0].tobytes() == original


def test_a_half_scale_copy_changed_in_place_is_refused_as_the_copy(tmp_path):
    halves = build_sample_shards(tmp_path, classes=2, train_per_class=3, val_per_class=1, half_copies=True)
    split = ShardDataset.open("x", halves).splits["train"]
    offset, size = split.location(0, half=True)
    _overwrite(halves / split.shard_of(0), offset + size // 2, b"\0" * 16)
    with pytest.raises(SampleCorrupt, match=f"the half-scale copy of sample {split.keys[0]} differs") as caught:
        split.read(0, half=True)
    assert caught.value.half and caught.value.index == 0
    assert sample_checksum(split.read(0)) == read_index(halves, "train").column("checksum")[0].as_py()


def test_an_index_without_checksums_is_served_unchecked_as_before(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    path = index_path(copy, "val")
    pq.write_table(pq.read_table(path).drop_columns(list(CHECKSUM_COLUMNS))
                   .replace_schema_metadata({INDEX_VERSION_KEY: b"2"}), path)
    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["val"]["index_version"] = 2
    (copy / "manifest.json").write_text(json.dumps(manifest))
    seal_index(copy, "val")
    split = ShardDataset.open("x", copy).splits["val"]
    assert read_index(copy, "val").column("checksum").null_count == len(split)
    offset, size = split.location(1)
    _overwrite(copy / split.shard_of(1), offset, b"\xff" * size)
    assert split.read(1).tobytes() == b"\xff" * size


def test_a_tar_rewritten_in_place_is_noticed_and_its_listeners_called(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    split = ShardDataset.open("x", copy, recheck_s=0).splits["train"]
    changed: list[str] = []
    split.on_shard_changed(changed.append)
    shard = split.shard_of(0)
    expected = split.read(0).tobytes()
    tar = copy / shard
    tar.write_bytes(tar.read_bytes())  # the same bytes written again: same size, a new mtime
    assert split.read(0).tobytes() == expected
    assert changed == [shard] and split.shard_generation(shard) == 1
    assert all(split.shard_generation(other) == 0 for other in {split.shard_of(i) for i in range(len(split))} - {shard})


def test_bytes_changed_under_a_served_tar_are_refused_and_the_change_reported_at_once(shards, tmp_path):
    copy = Path(shutil.copytree(shards, tmp_path / "copy"))
    split = ShardDataset.open("x", copy).splits["train"]  # tars looked at once a second
    changed: list[str] = []
    split.on_shard_changed(changed.append)
    shard, (offset, size) = split.shard_of(3), split.location(3)
    original = split.read(3).tobytes()
    _overwrite(copy / shard, offset, bytes(size))
    with pytest.raises(SampleCorrupt, match=split.keys[3]):  # changed, and still not the sample
        split.read(3)
    assert changed == [shard] and split.shard_generation(shard) == 1
    replacement = tmp_path / "restored.tar"  # the right bytes back, as a new file under the name
    replacement.write_bytes((shards / shard).read_bytes())
    os.replace(replacement, copy / shard)
    assert split.read(3).tobytes() == original
    assert changed == [shard, shard] and split.shard_generation(shard) == 2
