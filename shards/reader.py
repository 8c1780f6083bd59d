"""The one reader of the shard format (:mod:`shards.layout`): the manifest, each
split's ``index.parquet``, the tar members and their DALI ``.idx`` files, LMDB values,
and sample bytes sliced from memory-mapped tars. The daemon, ``feeder verify`` and the
benchmarks read shards only through this module; :mod:`shards.writers` is its
counterpart.

Opening checks what serving needs, so a bad path stops the daemon at start-up with
one line instead of failing a client later: the manifest parses and has a version
this code reads, every split's index has the expected columns, its row count matches
the manifest, and every sample lies inside an existing shard.
"""

from __future__ import annotations

import json
import mmap
import tarfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ConfigError, DataError, NotFound
from shards.datum import decode_datum
from shards.layout import FORMAT_VERSION, INDEX_SCHEMA, MANIFEST_NAME, index_path

__all__ = [
    "ShardDataset",
    "SplitIndex",
    "idx_members",
    "label_offset",
    "read_index",
    "read_lmdb_sample",
    "read_manifest",
    "tar_members",
]

_BLOCK = 512  # tar block size


@dataclass(frozen=True)
class _Columns:
    keys: list[str]
    labels: np.ndarray
    shard_ids: np.ndarray
    offsets: np.ndarray
    sizes: np.ndarray
    widths: np.ndarray
    heights: np.ndarray


class SplitIndex:
    """One split: per-sample key, label, image size and location, and the bytes
    behind them. ``widths`` / ``heights`` (pixels, as stored) let crop windows be
    drawn before anything is decoded.

    Thread-safe for reads: the tars are mapped read-only, once, on first use.
    """

    def __init__(self, root: Path, split: str, columns: _Columns, shards: list[str]) -> None:
        self.root = root
        self.split = split
        self.keys = columns.keys
        self.labels = columns.labels
        self.widths = columns.widths
        self.heights = columns.heights
        self._cols = columns
        self._shards = shards
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def shard_paths(self) -> list[Path]:
        """The split's tars, in the order the index first names them."""
        return [self.root / shard for shard in self._shards]

    def read(self, index: int) -> np.ndarray:
        """Encoded bytes of sample ``index`` as a uint8 view of the mapped tar."""
        shard = int(self._cols.shard_ids[index])
        return np.frombuffer(
            self._map(shard),
            dtype=np.uint8,
            count=int(self._cols.sizes[index]),
            offset=int(self._cols.offsets[index]),
        )

    def read_many(self, indices: Sequence[int] | np.ndarray) -> list[np.ndarray]:
        """:meth:`read` for each index, in order."""
        return [self.read(int(i)) for i in indices]

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None:
        """Ask the kernel to start reading these samples from disk now, without
        waiting, so the reader stays ahead of the pipeline on a cold page cache."""
        if not hasattr(mmap, "MADV_WILLNEED"):
            return
        for i in indices:
            offset, size = int(self._cols.offsets[i]), int(self._cols.sizes[i])
            start = offset - offset % mmap.PAGESIZE  # madvise needs a page-aligned start
            self._map(int(self._cols.shard_ids[i])).madvise(mmap.MADV_WILLNEED, start, size + offset - start)

    def _map(self, shard: int) -> mmap.mmap:
        found = self._maps.get(shard)
        if found is not None:
            return found
        with self._lock:
            if shard not in self._maps:
                with open(self.root / self._shards[shard], "rb") as f:
                    self._maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            return self._maps[shard]


@dataclass(frozen=True)
class ShardDataset:
    """A named shard directory with its splits.

    Attributes:
        name: the name clients ask for.
        root: the shard directory.
        classes: class names; label ``i`` is ``classes[i]``.
        splits: split name -> index.
    """

    name: str
    root: Path
    classes: list[str]
    splits: dict[str, SplitIndex]

    @classmethod
    def open(cls, name: str, root: Path) -> ShardDataset:
        """Open and check ``root``.

        Raises:
            NotFound: the directory or its manifest does not exist.
            DataError: the manifest or an index is unreadable or inconsistent.
        """
        root = Path(root)
        manifest = _checked_manifest(root)
        classes = [str(c) for c in manifest.get("classes", [])]
        splits = {}
        for split, info in manifest["splits"].items():
            _check_has_tars(root, str(split), info)
            _check_shard_sizes(root, info)
            splits[str(split)] = _open_split(root, str(split), info.get("num_samples"))
        if not splits:
            raise DataError(f"{root}: manifest lists no splits")
        return cls(name=name, root=root, classes=classes, splits=splits)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of shard directory ``root``.

    Raises:
        NotFound: no manifest (not a shard directory, or an unfinished run).
        DataError: unreadable JSON or a format version this code does not know.
    """
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise NotFound(f"{path} does not exist (not a shard directory, or sharding did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def _checked_manifest(root: Path) -> dict[str, Any]:
    if not root.is_dir():
        raise NotFound(f"{root}: no such shard directory")
    manifest = read_manifest(root)
    if not isinstance(manifest.get("splits"), dict) or not isinstance(manifest.get("classes"), list):
        raise DataError(f"{root / MANIFEST_NAME}: no 'splits' object or 'classes' list")
    return manifest


def _check_has_tars(root: Path, split: str, info: dict[str, Any]) -> None:
    """The daemon reads sample bytes out of the WebDataset tars; an LMDB-only split
    (``feeder shard --format lmdb``) has none."""
    if info.get("num_samples") and not info.get("shards"):
        raise ConfigError(
            f"{root}: split {split!r} has no WebDataset tars (sharded with --format lmdb only); "
            "reshard with --format wds or wds,lmdb to serve it"
        )


def _check_shard_sizes(root: Path, info: dict[str, Any]) -> None:
    """Each shard the manifest lists exists with the recorded size (a cheap check;
    ``feeder verify`` compares checksums)."""
    for shard in info.get("shards", []):
        file = root / str(shard["path"])
        if not file.is_file():
            raise DataError(f"{file}: listed in the manifest but missing")
        if "bytes" in shard and file.stat().st_size != int(shard["bytes"]):
            raise DataError(f"{file}: {file.stat().st_size} bytes, manifest says {shard['bytes']}")


def read_index(root: Path, split: str, columns: Sequence[str] | None = None) -> pa.Table:
    """The rows of ``<split>/index.parquet`` (``columns`` of them, or all).

    Raises:
        DataError: the file is missing, unreadable, or a column has another type than
            ``INDEX_SCHEMA`` says.
    """
    path = index_path(root, split)
    if not path.is_file():
        raise DataError(f"{path}: missing index of split {split!r}")
    names = list(columns) if columns is not None else INDEX_SCHEMA.names
    try:
        table = pq.read_table(path, columns=names)
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"{path}: not a readable index ({str(e).splitlines()[0]})") from e
    for column in names:
        if table.schema.field(column).type != INDEX_SCHEMA.field(column).type:
            raise DataError(f"{path}: column {column!r} has type {table.schema.field(column).type}")
    return table


def tar_members(path: Path) -> dict[str, tuple[int, int]]:
    """Member name -> (data offset, size) of every file in the tar at ``path``.

    Raises:
        DataError: not a readable tar.
    """
    try:
        with tarfile.open(path) as tar:
            return {m.name: (m.offset_data, m.size) for m in tar if m.isfile()}
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"{path}: not a readable tar ({e})") from e


def idx_members(path: Path) -> dict[str, tuple[int, int]]:
    """Member name -> (data offset, size) as a DALI ``.idx`` file lists them
    (``v1.2 N`` header, then ``type offset size name`` groups per sample line). A
    bad header adds the member ``"<header>"`` so the result never equals a tar's."""
    lines = path.read_text(encoding="ascii").splitlines()
    members = {}
    for line in lines[1:]:
        fields = line.split()
        for i in range(0, len(fields), 4):
            members[fields[i + 3]] = (int(fields[i + 1]), int(fields[i + 2]))
    if not lines or lines[0].split() != ["v1.2", str(len(lines) - 1)]:
        members["<header>"] = (-1, -1)
    return members


def label_offset(data_offset: int, data_size: int) -> int:
    """Where the data of a sample's ``.cls`` member starts, given its ``.jpg`` member's
    data offset and size (the writer puts ``.cls`` right after ``.jpg``: the image data
    padded to whole blocks, then one header block)."""
    return data_offset + -(-data_size // _BLOCK) * _BLOCK + _BLOCK


def read_lmdb_sample(env: lmdb.Environment, key: str) -> tuple[bytes, int]:
    """The encoded image and label stored under ``key`` (a Caffe ``Datum``); empty
    bytes and -1 when the key is absent."""
    with env.begin() as txn:
        fields = decode_datum(txn.get(key.encode()) or b"")
    data, label = fields.get(4, b""), fields.get(5, -1)
    return bytes(data) if isinstance(data, bytes) else b"", int(label) if isinstance(label, int) else -1


def _open_split(root: Path, split: str, expected: int | None) -> SplitIndex:
    path = index_path(root, split)
    table = read_index(root, split, ["key", "label", "shard", "offset", "size", "width", "height"])
    if expected is not None and table.num_rows != expected:
        raise DataError(f"{path}: {table.num_rows} rows, manifest says {expected}")
    shard_col = table.column("shard").dictionary_encode().combine_chunks()
    shards = [str(s) for s in shard_col.dictionary.to_pylist()]
    columns = _Columns(
        keys=table.column("key").to_pylist(),
        labels=table.column("label").to_numpy().astype(np.int64),
        shard_ids=shard_col.indices.to_numpy().astype(np.int32),
        offsets=table.column("offset").to_numpy().astype(np.int64),
        sizes=table.column("size").to_numpy().astype(np.int64),
        widths=table.column("width").to_numpy().astype(np.int32),
        heights=table.column("height").to_numpy().astype(np.int32),
    )
    _check_extents(root, path, columns, shards)
    _check_image_sizes(path, columns)
    return SplitIndex(root, split, columns, shards)


def _check_extents(root: Path, path: Path, cols: _Columns, shards: list[str]) -> None:
    for shard_id, shard in enumerate(shards):
        file = root / shard
        if not file.is_file():
            raise DataError(f"{path}: shard {shard} is missing")
        mine = cols.shard_ids == shard_id
        end = int((cols.offsets[mine] + cols.sizes[mine]).max(initial=0))
        if end > file.stat().st_size:
            raise DataError(f"{file}: {file.stat().st_size} bytes, index points to byte {end}")


def _check_image_sizes(path: Path, cols: _Columns) -> None:
    """Crop windows are drawn from the index's sizes; a row without one cannot be served."""
    bad = np.flatnonzero((cols.widths < 1) | (cols.heights < 1))
    if len(bad):
        raise DataError(f"{path}: no image size for key {cols.keys[int(bad[0])]!r} ({len(bad)} rows)")
