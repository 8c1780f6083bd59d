"""Reading each split's ``index.parquet`` of a shard directory, with the checks that
serving needs (:mod:`shards.layout` is the contract; :mod:`shards.manifest` reads the
manifest, and its reader is named here too, where it was first).

Opening checks what serving needs, so a bad path stops the daemon at start-up with
one line instead of failing a client later: the manifest parses, has a version this
code reads and fields of the types the reader uses, every split's index has the
expected columns, its row count matches the manifest, every label names one of the
manifest's classes, and every sample lies inside an existing shard. Nothing here reads
sample bytes: :mod:`shards.reader` does, through the columns read here.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ConfigError, DataError
from shards.beneath import open_beneath
from shards.layout import (
    CHECKSUM_COLUMNS,
    HALF_COLUMNS,
    INDEX_SCHEMA,
    INDEX_VERSION,
    INDEX_VERSION_KEY,
    file_sha256,
    index_path,
    index_schema,
)
from shards.manifest import Root, SplitEntry, is_inside, read_manifest

__all__ = [
    "IndexColumns",
    "check_split_shards",
    "index_version",
    "read_columns",
    "read_index",
    "read_manifest",
]

# The columns the daemon serves from (``source`` stays on disk).
_SERVED = ("key", "label", "shard", "offset", "size", "width", "height", *HALF_COLUMNS, *CHECKSUM_COLUMNS)


@dataclass(frozen=True)
class IndexColumns:
    """A split's index as arrays, one entry per sample, and its tars.

    Attributes:
        version: the index's format version (:mod:`shards.layout`).
        shards: the split's tars relative to the shard directory, in the order the
            index first names them; ``shard_ids`` are positions in this list.
        half_sizes: 0 where a sample has no half-scale copy.
        checksums: uint64 ``sample_checksum`` of each sample's bytes, and
            ``half_checksums`` of its half-scale copy's; None for an index without
            them (version 1 or 2): its samples are not checked.
        sha256: of the ``index.parquet`` read (the split's identity beside the
            manifest's: :mod:`protocol.identity`).
    """

    version: int
    shards: list[str]
    keys: list[str]
    labels: np.ndarray
    shard_ids: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    widths: np.ndarray
    heights: np.ndarray
    half_offsets: np.ndarray
    half_sizes: np.ndarray
    checksums: np.ndarray | None
    half_checksums: np.ndarray | None
    sha256: str = ""


def check_split_shards(root: Root, split: str, info: SplitEntry) -> None:
    """The split has WebDataset tars (the daemon reads sample bytes out of them; an
    LMDB-only split, ``feeder shard --formats lmdb``, has none), and each one the
    manifest lists exists with the recorded size (a cheap check; ``feeder verify``
    compares checksums).

    Raises:
        ConfigError: an LMDB-only split.
        DataError: a listed tar is missing or of another size.
    """
    if info.num_samples and not info.shards:
        raise ConfigError(
            f"{root}: split {split!r} has no WebDataset tars (sharded with --formats lmdb only); "
            "reshard with --formats wds or wds,lmdb to serve it"
        )
    for shard in info.shards:
        file = root / shard.path
        if not file.is_file():
            raise DataError(f"{file}: listed in the manifest but missing")
        if file.stat().st_size != shard.bytes:
            raise DataError(f"{file}: {file.stat().st_size} bytes, manifest says {shard.bytes}")


def index_version(path: Root) -> int:
    """The format version of the index at ``path`` (:mod:`shards.layout`): the one in
    its schema metadata, or, where there is none, 2 when it has the columns of the
    half-scale copies, else 1.

    Raises:
        DataError: the file is unreadable, or its version is not a number, later
            than ``INDEX_VERSION`` (names the file and both versions) or lacks one of
            that version's columns.
    """
    try:
        schema = pq.read_schema(path)
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"{path}: not a readable index ({str(e).splitlines()[0]})") from e
    recorded = (schema.metadata or {}).get(INDEX_VERSION_KEY)
    if recorded is None:
        return 2 if set(HALF_COLUMNS) <= set(schema.names) else 1
    text = recorded.decode("ascii", "replace")
    if not text.isdigit() or int(text) < 1:
        raise DataError(f"{path}: index format version {text!r} is not a version number")
    version = int(text)
    if version > INDEX_VERSION:
        raise DataError(f"{path}: index format version {version}; this reader reads versions 1 to {INDEX_VERSION}")
    missing = [name for name in index_schema(version).names if name not in schema.names]
    if missing:
        raise DataError(f"{path}: index format version {version} without its column {missing[0]!r}")
    return version


def read_index(root: Root, split: str, columns: Sequence[str] | None = None) -> pa.Table:
    """The rows of ``<split>/index.parquet`` (``columns`` of them, or all those of
    ``INDEX_SCHEMA``), from an index of any version this code reads, with that
    version in the table's schema metadata (``INDEX_VERSION_KEY``). Columns the
    version lacks come as "none": the half-scale copies' as ``-1`` / ``0`` (no copy),
    the checksums as nulls (unchecked).

    Raises:
        DataError: the file is missing or unreadable, of a version this code does not
            read, or a column has another type than ``INDEX_SCHEMA`` says.
    """
    path = index_path(root, split)
    if not path.is_file():
        raise DataError(f"{path}: missing index of split {split!r}")
    names = list(columns) if columns is not None else INDEX_SCHEMA.names
    version = index_version(path)
    stored = index_schema(version).names
    try:
        table = pq.read_table(path, columns=[c for c in names if c in stored])
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"{path}: not a readable index ({str(e).splitlines()[0]})") from e
    for column in (c for c in names if c not in stored):
        table = table.append_column(INDEX_SCHEMA.field(column), _absent(INDEX_SCHEMA.field(column), table.num_rows))
    table = table.select(names)
    for column in names:
        if table.schema.field(column).type != INDEX_SCHEMA.field(column).type:
            raise DataError(f"{path}: column {column!r} has type {table.schema.field(column).type}")
    return table.replace_schema_metadata({INDEX_VERSION_KEY: str(version).encode("ascii")})


def _absent(field: pa.Field, rows: int) -> pa.Array:
    """The values of a column an index's version lacks: what says "none"."""
    if field.name in CHECKSUM_COLUMNS:
        return pa.nulls(rows, field.type)
    fill = -1 if field.name == "half_offset" else 0
    return pa.array(np.full(rows, fill), field.type)


def read_columns(root: Root, split: str, info: SplitEntry, num_classes: int | None = None,
                 allowed_links: tuple[Path, ...] = ()) -> IndexColumns:
    """The index of ``split`` as arrays, checked against the manifest entry ``info``
    and the tars: the row count and format version, every label one of
    ``num_classes`` (the manifest's classes; None: unchecked), every sample inside its
    tar (a local tar opened beneath ``root``, or one of ``allowed_links``), an image
    size on every row, and the columns of the half-scale copies either locating one or
    saying there is none.

    Raises:
        DataError: the index is missing, unreadable or disagrees (names the file, and
            the first bad key where there is one).
    """
    path = index_path(root, split)
    table = read_index(root, split, _SERVED)
    digest = _checked_digest(path, info)
    if table.num_rows != info.num_samples:
        raise DataError(f"{path}: {table.num_rows} rows, manifest says {info.num_samples}")
    version = int(table.schema.metadata[INDEX_VERSION_KEY])
    if info.index_version is not None and info.index_version != version:
        raise DataError(f"{path}: index format version {version}, manifest says {info.index_version!r}")
    shard_col = table.column("shard").dictionary_encode().combine_chunks()
    columns = IndexColumns(
        version=version,
        shards=[str(s) for s in shard_col.dictionary.to_pylist()],
        keys=table.column("key").to_pylist(),
        labels=table.column("label").to_numpy().astype(np.int64),
        shard_ids=shard_col.indices.to_numpy().astype(np.int32),
        offsets=table.column("offset").to_numpy().astype(np.int64),
        sizes=table.column("size").to_numpy().astype(np.int64),
        widths=table.column("width").to_numpy().astype(np.int32),
        heights=table.column("height").to_numpy().astype(np.int32),
        half_offsets=table.column("half_offset").to_numpy().astype(np.int64),
        half_sizes=table.column("half_size").to_numpy().astype(np.int64),
        checksums=_checksums(path, table, "checksum", version),
        half_checksums=_checksums(path, table, "half_checksum", version),
        sha256=digest,
    )
    if num_classes is not None:
        _check_labels(path, columns, num_classes)
    _check_half_copies(path, columns)  # each row locates a copy or says it has none
    _check_sample_extents(path, columns)
    _check_extents(root, path, columns, allowed_links)
    _check_image_sizes(path, columns)
    return columns


def _checked_digest(path: Root, info: SplitEntry) -> str:
    """The sha256 of the index file, checked against the manifest's ``index_sha256``
    where it has one: the samples' checksums cover their bytes, not their labels or
    keys, so an index changed after sharding would otherwise be served as it is.

    Raises:
        DataError: its sha256 differs (names the file).
    """
    digest = file_sha256(path)
    expected = info.index_sha256
    if expected and digest != expected:
        raise DataError(f"{path}: sha256 {digest[:12]}, the manifest's index_sha256 is {expected[:12]} (changed "
                        "after sharding: its keys, labels or offsets are not the dataset's)")
    return digest


def _check_labels(path: Root, cols: IndexColumns, num_classes: int) -> None:
    """Label ``i`` is the manifest's class ``i``: one past its list would be served as
    a class the training run does not have."""
    if not len(cols.labels):
        return
    if int(cols.labels.min()) < 0:
        row = int(np.argmin(cols.labels))
        raise DataError(f"{path}: key {cols.keys[row]!r} has label {int(cols.labels[row])}")
    highest = int(cols.labels.max())
    if highest >= num_classes:
        raise DataError(f"{path}: labels up to {highest}, but the manifest lists {num_classes} classes")


def _checksums(path: Root, table: pa.Table, column: str, version: int) -> np.ndarray | None:
    if version < 3:
        return None
    values = table.column(column)
    if values.null_count:
        raise DataError(f"{path}: {values.null_count} rows without a {column!r}")
    return values.to_numpy().astype(np.uint64)


def _check_sample_extents(path: Root, cols: IndexColumns) -> None:
    """Every sample's bytes (and its half-scale copy's) are a range of its tar of their
    own: a negative offset or size would fail deep in a read, and two rows sharing
    bytes would serve one image under two keys.

    Raises:
        DataError: naming the index (its split), the row and its key.
    """
    bad = np.flatnonzero((cols.offsets < 0) | (cols.sizes < 1))
    if len(bad):
        at = int(bad[0])
        raise DataError(f"{path}: row {at} (key {cols.keys[at]!r}) has offset {int(cols.offsets[at])}, size "
                        f"{int(cols.sizes[at])} ({len(bad)} such rows)")
    rows = np.arange(len(cols.offsets))
    half = cols.half_sizes > 0
    shard = np.concatenate([cols.shard_ids, cols.shard_ids[half]])
    start = np.concatenate([cols.offsets, cols.half_offsets[half]])
    end = np.concatenate([cols.offsets + cols.sizes, cols.half_offsets[half] + cols.half_sizes[half]])
    row = np.concatenate([rows, rows[half]])
    key = (shard.astype(np.int64) << 40) | start  # one sort key: a tar is under 1 TiB
    if len(key) > 1 and not bool(np.all(key[1:] >= key[:-1])):  # as the sharder writes them: in order already
        order = np.argsort(key, kind="stable")
        shard, start, end, row = shard[order], start[order], end[order], row[order]
    overlap = np.flatnonzero((shard[1:] == shard[:-1]) & (start[1:] < end[:-1]))
    if len(overlap):
        i = int(overlap[0])
        first, second = int(row[i]), int(row[i + 1])
        raise DataError(f"{path}: rows {first} and {second} (keys {cols.keys[first]!r} and {cols.keys[second]!r}) "
                        f"overlap in {cols.shards[int(shard[i])]} at bytes {int(start[i + 1])}..{int(end[i])} "
                        f"({len(overlap)} overlaps)")


def _check_extents(root: Root, path: Root, cols: IndexColumns, allowed_links: tuple[Path, ...]) -> None:
    for shard_id, shard in enumerate(cols.shards):
        if not is_inside(shard):  # the daemon opens it under the root: no other file
            raise DataError(f"{path}: shard {shard[:200]!r} is not a relative path inside the shard directory")
        file = root / shard
        if not file.is_file():
            raise DataError(f"{path}: shard {shard} is missing")
        if isinstance(root, Path):
            _check_beneath(root, shard, allowed_links)
        mine = cols.shard_ids == shard_id
        ends = np.maximum(cols.offsets[mine] + cols.sizes[mine], cols.half_offsets[mine] + cols.half_sizes[mine])
        end = int(ends.max(initial=0))
        if end > file.stat().st_size:
            raise DataError(f"{file}: {file.stat().st_size} bytes, index points to byte {end}")


def _check_beneath(root: Path, shard: str, allowed_links: tuple[Path, ...]) -> None:
    """A local tar opens beneath the root (a link may lead only to an allowed directory).

    Raises:
        DataError: it leads elsewhere, or cannot be opened (names it).
    """
    try:
        os.close(open_beneath(root, shard, allowed_links))
    except OSError as e:
        raise DataError(f"{root / shard}: {e.strerror or e}") from e


def _check_image_sizes(path: Root, cols: IndexColumns) -> None:
    """Crop windows are drawn from the index's sizes; a row without one cannot be served."""
    bad = np.flatnonzero((cols.widths < 1) | (cols.heights < 1))
    if len(bad):
        raise DataError(f"{path}: no image size for key {cols.keys[int(bad[0])]!r} ({len(bad)} rows)")


def _check_half_copies(path: Root, cols: IndexColumns) -> None:
    """A row's columns of the copies either locate one or say there is none (where
    it lies is checked after: ``_check_sample_extents``, ``_check_extents``)."""
    bad = np.flatnonzero((cols.half_sizes < 0) | ((cols.half_sizes > 0) & (cols.half_offsets < 0)))
    if len(bad):
        row = int(bad[0])
        raise DataError(f"{path}: key {cols.keys[row]!r} has half_offset {int(cols.half_offsets[row])}, "
                        f"half_size {int(cols.half_sizes[row])} ({len(bad)} rows)")
