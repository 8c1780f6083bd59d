"""Reading the index of every format version, and refusing one this code does not know."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from shards.index import index_version, read_index
from shards.layout import HALF_COLUMNS, INDEX_VERSION, INDEX_VERSION_KEY, file_sha256, index_path
from shards.reader import ShardDataset
from tests.common.shards import seal_index


def _copy(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


def _rewrite(root: Path, split: str, drop: tuple[str, ...] = (), metadata: dict[bytes, bytes] | None = None) -> None:
    """The split's index written again without ``drop`` and with ``metadata`` as its
    schema metadata (None: none, as indexes written before versions were recorded)."""
    path = index_path(root, split)
    table = pq.read_table(path)
    table = table.drop_columns(list(drop)).replace_schema_metadata(metadata)
    pq.write_table(table, path)
    seal_index(root, split)


def test_the_sharder_records_its_version_in_the_index_and_the_manifest(shards: Path) -> None:
    assert index_version(index_path(shards, "train")) == INDEX_VERSION
    assert pq.read_schema(index_path(shards, "train")).metadata[INDEX_VERSION_KEY] == str(INDEX_VERSION).encode()
    manifest = json.loads((shards / "manifest.json").read_text())
    assert {entry["index_version"] for entry in manifest["splits"].values()} == {INDEX_VERSION}
    assert ShardDataset.open("s", shards).splits["train"].index_version == INDEX_VERSION


@pytest.mark.parametrize(("drop", "expected"), [((), 2), (HALF_COLUMNS, 1)])
def test_an_index_without_a_version_is_read_by_its_columns(shards: Path, tmp_path: Path, drop, expected) -> None:
    copy = _copy(shards, tmp_path)
    _rewrite(copy, "val", drop)  # as written before versions were recorded, in the manifest too
    manifest = json.loads((copy / "manifest.json").read_text())
    del manifest["splits"]["val"]["index_version"]
    (copy / "manifest.json").write_text(json.dumps(manifest))
    assert index_version(index_path(copy, "val")) == expected
    split = ShardDataset.open("s", copy).splits["val"]
    assert split.index_version == expected
    original = ShardDataset.open("s", shards).splits["val"]
    rows = range(len(split))
    assert [split.read(i).tobytes() for i in rows] == [original.read(i).tobytes() for i in rows]
    assert read_index(copy, "val").column("half_size").to_pylist() == [0] * len(split)


def test_a_later_version_is_refused_naming_the_file_and_both_versions(shards: Path, tmp_path: Path) -> None:
    copy = _copy(shards, tmp_path)
    later = INDEX_VERSION + 1
    _rewrite(copy, "val", metadata={INDEX_VERSION_KEY: str(later).encode()})
    message = (rf"{index_path(copy, 'val')}: index format version {later}; "
               rf"this reader reads versions 1 to {INDEX_VERSION}$")
    with pytest.raises(DataError, match=message):
        ShardDataset.open("s", copy)
    with pytest.raises(DataError, match=message):
        read_index(copy, "val")


@pytest.mark.parametrize(("metadata", "fragment"), [
    ({INDEX_VERSION_KEY: b"two"}, "'two' is not a version number"),
    ({INDEX_VERSION_KEY: b"0"}, "'0' is not a version number"),
])
def test_a_version_that_is_not_one_is_refused(shards: Path, tmp_path: Path, metadata, fragment) -> None:
    copy = _copy(shards, tmp_path)
    _rewrite(copy, "val", metadata=metadata)
    with pytest.raises(DataError, match=rf"index.parquet: index format version {fragment}"):
        ShardDataset.open("s", copy)


def test_a_version_without_its_columns_is_refused(shards: Path, tmp_path: Path) -> None:
    copy = _copy(shards, tmp_path)
    _rewrite(copy, "val", drop=HALF_COLUMNS, metadata={INDEX_VERSION_KEY: b"2"})
    with pytest.raises(DataError, match="index format version 2 without its column 'half_offset'"):
        ShardDataset.open("s", copy)


def test_an_index_of_another_version_than_the_manifest_says_is_refused(shards: Path, tmp_path: Path) -> None:
    copy = _copy(shards, tmp_path)
    _rewrite(copy, "val", drop=HALF_COLUMNS, metadata={INDEX_VERSION_KEY: b"1"})
    with pytest.raises(DataError, match=rf"index format version 1, manifest says {INDEX_VERSION}"):
        ShardDataset.open("s", copy)


@pytest.mark.parametrize("shard", ["../outside.tar", "/etc/passwd", "val/../../outside.tar"])
def test_an_index_naming_a_file_outside_the_directory_is_refused(shards: Path, tmp_path: Path, shard: str) -> None:
    copy = _copy(shards, tmp_path)
    (tmp_path / "outside.tar").write_bytes((copy / "val" / "shard-000000.tar").read_bytes())  # a real tar there
    path = index_path(copy, "val")
    table = pq.read_table(path)
    column = table.schema.get_field_index("shard")
    table = table.set_column(column, "shard", pa.array([shard] * table.num_rows))
    pq.write_table(table, path)
    seal_index(copy, "val")
    with pytest.raises(DataError, match=rf"{path}: shard '{shard}' is not a relative path inside the shard directory"):
        ShardDataset.open("s", copy)


def _permute_labels(root: Path, split: str) -> Path:
    """The split's index with its labels in another order (every row still valid)."""
    path = index_path(root, split)
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels[1:] + labels[:1]))
    pq.write_table(table, path)
    return path


def test_an_index_changed_after_sharding_is_refused_naming_it_and_both_digests(shards: Path, tmp_path: Path) -> None:
    # The samples' checksums cover their bytes, not their labels. Before: an index with
    # its labels permuted was served as it was (half the samples with wrong labels).
    copy = _copy(shards, tmp_path)
    path = _permute_labels(copy, "train")
    expected = json.loads((copy / "manifest.json").read_text())["splits"]["train"]["index_sha256"]
    with pytest.raises(DataError, match=rf"^{path}: sha256 [0-9a-f]{{12}}, the manifest's index_sha256 is "
                                        rf"{expected[:12]} \(changed after sharding"):
        ShardDataset.open("s", copy)


@pytest.mark.slow
def test_feeder_serve_refuses_an_index_changed_after_sharding_with_one_line(shards: Path, tmp_path: Path) -> None:
    copy = _copy(shards, tmp_path)
    path = _permute_labels(copy, "val")
    command = [sys.executable, "-m", "feeder", "serve", "--port", "0", "--threads", "1", "--dataset", f"x={copy}"]
    process = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert process.returncode == 1, process.stderr
    assert process.stderr.count("\n") == 1 and process.stderr.startswith(f"feeder: bad data: {path}: sha256 "), \
        process.stderr


def test_the_served_index_digest_is_the_files(shards: Path) -> None:
    split = ShardDataset.open("s", shards).splits["train"]
    assert split.index_sha256 == file_sha256(index_path(shards, "train"))


def _with_column(root: Path, split: str, column: str, change) -> None:
    path = index_path(root, split)
    table = pq.read_table(path)
    values = table.column(column).to_pylist()
    change(values)
    at = table.schema.get_field_index(column)
    pq.write_table(table.set_column(at, column, pa.array(values, type=table.schema.field(column).type)), path)
    seal_index(root, split)


@pytest.mark.parametrize(("column", "value", "fragment"), [
    ("offset", -512, "has offset -512"), ("size", -3, "size -3"), ("size", 0, "size 0"),
])
def test_a_negative_or_empty_extent_is_refused_at_start_naming_split_and_row(shards, tmp_path, column, value,
                                                                            fragment) -> None:
    copy = _copy(shards, tmp_path)
    _with_column(copy, "val", column, lambda values: values.__setitem__(2, value))
    with pytest.raises(DataError, match=rf"val/index.parquet: row 2 \(key '[^']+'\) .*{fragment}"):
        ShardDataset.open("s", copy)


@pytest.mark.parametrize("column", ["offset", "half_offset"])
def test_rows_sharing_bytes_are_refused_at_start_naming_both(shards, tmp_path, column) -> None:
    # One image served under two keys (with two labels), or a half-scale copy read from
    # another sample's bytes.
    copy = _copy(shards, tmp_path)
    table = pq.read_table(index_path(copy, "val"))
    same_tar = [i for i, s in enumerate(table.column("shard").to_pylist()) if s == table.column("shard")[0].as_py()]
    first, second = same_tar[0], same_tar[1]
    offsets = table.column("offset").to_pylist()
    _with_column(copy, "val", column, lambda values: values.__setitem__(second, offsets[first] + 1))
    if column == "half_offset":  # a copy of its own, where the first sample's bytes are
        _with_column(copy, "val", "half_size", lambda values: values.__setitem__(second, 10))
    with pytest.raises(DataError, match=r"val/index.parquet: rows \d+ and \d+ \(keys .*\) overlap in "):
        ShardDataset.open("s", copy)
