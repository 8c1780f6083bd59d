"""The one reader of the shard format (:mod:`shards.layout`): the manifest, each
split's ``index.parquet``, the tar members and their DALI ``.idx`` files, LMDB values,
and sample bytes read from the tars. The daemon, ``feeder verify`` and the
benchmarks read shards only through this module; :mod:`shards.writers` is its
counterpart.

Opening checks what serving needs, so a bad path stops the daemon at start-up with
one line instead of failing a client later: the manifest parses and has a version
this code reads, every split's index has the expected columns, its row count matches
the manifest, and every sample lies inside an existing shard.
"""

from __future__ import annotations

import json
import os
import tarfile
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import lmdb
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.errors import ConfigError, DataError, NotFound
from shards.datum import decode_datum
from shards.jpeg import dct_denominator
from shards.layout import FORMAT_VERSION, HALF_COLUMNS, INDEX_SCHEMA, MANIFEST_NAME, index_path

__all__ = [
    "ShardDataset",
    "SplitIndex",
    "idx_members",
    "label_offset",
    "read_index",
    "read_lmdb_sample",
    "read_manifest",
    "half_boxes",
    "TarScan",
    "Windows",
    "scan_tar",
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
    half_offsets: np.ndarray
    half_sizes: np.ndarray  # 0: no half-scale copy


class _OpenShard:
    """An open tar: its descriptor and the identity of the file it was opened as."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        stat = os.fstat(self.fd)
        self.identity = (stat.st_dev, stat.st_ino)
        # Reads first try RWF_NOWAIT (Linux): it reads only what is in the page cache,
        # which tells cached reads from disk reads. Off where the file system refuses it.
        self._nowait = getattr(os, "RWF_NOWAIT", 0)

    def read_into(self, buffer: np.ndarray, offset: int) -> tuple[int, bool]:
        """Bytes read into ``buffer`` from ``offset`` (fewer than its size at end of
        file), and whether all of them came from the page cache (False where that is
        unknown)."""
        done, cached = 0, bool(self._nowait)
        if self._nowait:
            try:
                done = os.preadv(self.fd, [buffer.data], offset, self._nowait)
            except BlockingIOError:  # not (all) in the page cache
                pass
            except OSError:  # the file system does not do RWF_NOWAIT
                self._nowait = 0
            cached = done == len(buffer)
        while done < len(buffer):
            count = os.preadv(self.fd, [buffer.data[done:]], offset + done)
            if count == 0:
                break
            done += count
        return done, cached


class Windows(NamedTuple):
    """What :meth:`SplitIndex.read_windows` read: encoded bytes per sample, int32
    ``[N, 4]`` windows in those bytes' pixels, and which samples' bytes are their
    half-scale copies (bool ``[N]``)."""

    jpegs: list[np.ndarray]
    boxes: np.ndarray
    from_copies: np.ndarray


class SplitIndex:
    """One split: per-sample key, label, image size and location, and the bytes
    behind them. ``widths`` / ``heights`` (pixels, as stored) let crop windows be
    drawn before anything is decoded.

    Sample bytes are read with ``pread`` into fresh buffers, never sliced from a
    memory map: a tar that is truncated while it is served (``cp`` over it, ``rsync
    --inplace``, a network file system losing it) then gives a short read, raised as
    a :class:`DataError` naming the tar and the sample, instead of a SIGBUS that would
    end the whole process. Thread-safe for reads; tars are opened once, on first use.
    """

    def __init__(
        self, root: Path, split: str, columns: _Columns, shards: list[str], shard_bytes: dict[str, int] | None = None
    ) -> None:
        self.root = root
        self.split = split
        self.keys = columns.keys
        self.labels = columns.labels
        self.widths = columns.widths
        self.heights = columns.heights
        self._cols = columns
        self._shards = shards
        self._shard_bytes = shard_bytes or {}
        # Samples whose half-scale copy did not decode: read from the image instead.
        self._copy_usable = columns.half_sizes > 0
        self._open: dict[int, _OpenShard] = {}
        self._retired: list[_OpenShard] = []  # replaced files: other threads may still read them
        self._lock = threading.Lock()
        # Reads not served from the page cache alone (disk, or unknown), all threads
        # together: what read-ahead can help (see ``will_need``).
        self.uncached_reads = 0
        weakref.finalize(self, _close_all, self._open, self._retired)

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def shard_paths(self) -> list[Path]:
        """The split's tars, in the order the index first names them."""
        return [self.root / shard for shard in self._shards]

    def shard_of(self, index: int) -> str:
        """The tar holding sample ``index``, relative to the shard directory."""
        return self._shards[int(self._cols.shard_ids[index])]

    def location(self, index: int, half: bool = False) -> tuple[int, int]:
        """(offset, size) of sample ``index``'s JPEG bytes inside its tar (``half``:
        of its half-scale copy; size 0 where it has none)."""
        if half:
            return int(self._cols.half_offsets[index]), int(self._cols.half_sizes[index])
        return int(self._cols.offsets[index]), int(self._cols.sizes[index])

    @property
    def half_copies(self) -> np.ndarray:
        """bool ``[N]``: the sample has a half-scale copy (``feeder shard --half-copies``)."""
        return self._cols.half_sizes > 0

    def read(self, index: int, half: bool = False) -> np.ndarray:
        """Encoded bytes of sample ``index`` (a new uint8 array); ``half``: of its
        half-scale copy.

        Raises:
            DataError: the tar is missing or shorter than the index says (names the
                tar and the sample key); a tar replaced under the same name by a
                complete one (the size the manifest records) is reopened instead.
        """
        shard = int(self._cols.shard_ids[index])
        offset, size = self.location(index, half)
        if size <= 0:
            raise DataError(f"{self.root / self._shards[shard]}: sample {self.keys[index]} has no half-scale copy")
        buffer = np.empty(size, dtype=np.uint8)
        opened = self._file(shard)
        done, cached = opened.read_into(buffer, offset)
        if not cached:
            self.uncached_reads += 1
        if done == size:
            return buffer
        if self._reopen_if_replaced(shard, opened) and self._file(shard).read_into(buffer, offset)[0] == size:
            return buffer
        path = self.root / self._shards[shard]
        raise DataError(f"{path}: truncated while in use, sample {self.keys[index]} (bytes {offset}..{offset + size}) cut short")

    def read_many(self, indices: Sequence[int] | np.ndarray, half: np.ndarray | None = None) -> list[np.ndarray]:
        """:meth:`read` for each index, in order (``half[k]``: the copy of the k-th)."""
        if half is None:
            return [self.read(int(i)) for i in indices]
        return [self.read(int(i), bool(h)) for i, h in zip(indices, half)]

    def read_windows(self, indices: Sequence[int] | np.ndarray, boxes: np.ndarray, image_size: int) -> Windows:
        """The bytes to decode each sample's crop window from, and the windows in
        those bytes' pixels: the half-scale copy where the sample has one (that has
        not failed to decode, :meth:`drop_copies`) and its window is at least twice
        ``image_size`` on both sides (where the full image would be decoded at DCT
        scale 1/2 or less anyway), else the image itself.

        Args:
            indices: the samples.
            boxes: int ``[N, 4]`` windows (x, y, width, height) in the image's pixels.
            image_size: the output side they are resized to.
        """
        rows = np.asarray(indices, dtype=np.int64)
        boxes = np.asarray(boxes).astype(np.int32)
        twice = np.array([dct_denominator(int(w), int(h), image_size) >= 2 for w, h in boxes[:, 2:]], dtype=bool)
        half = self._copy_usable[rows] & twice.reshape(len(rows))
        if half.any():
            boxes = boxes.copy()
            boxes[half] = half_boxes(boxes[half], self.widths[rows[half]], self.heights[rows[half]])
        return Windows(self.read_many(rows, half), boxes, half)

    def drop_copies(self, indices: Sequence[int] | np.ndarray) -> None:
        """Read these samples' windows from their images from now on (their half-scale
        copies failed to decode; the images may still)."""
        self._copy_usable[np.asarray(indices, dtype=np.int64)] = False

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None:
        """Ask the kernel to start reading these samples from disk now, without
        waiting, so the reader stays ahead of the pipeline on a cold page cache."""
        if not hasattr(os, "posix_fadvise"):
            return
        for i in indices:  # the images: a half-scale copy lies right after its image
            offset, size = self.location(int(i))
            size = max(size, int(self._cols.half_offsets[i] + self._cols.half_sizes[i]) - offset)
            try:
                os.posix_fadvise(self._file(int(self._cols.shard_ids[i])).fd, offset, size, os.POSIX_FADV_WILLNEED)
            except (OSError, DataError):
                continue  # only a hint; the read itself reports a missing file

    def _file(self, shard: int) -> _OpenShard:
        found = self._open.get(shard)
        if found is not None:
            return found
        with self._lock:
            if shard not in self._open:
                path = self.root / self._shards[shard]
                try:
                    self._open[shard] = _OpenShard(path)
                except OSError as e:
                    raise DataError(f"{path}: cannot open shard: {e.strerror or e}") from e
            return self._open[shard]

    def _reopen_if_replaced(self, shard: int, stale: _OpenShard) -> bool:
        """Reopen ``shard`` when its path now names a complete file (the size the
        manifest records) other than ``stale``, or the same file grown back to that
        size (rewritten in place); True when a retry may succeed."""
        path = self.root / self._shards[shard]
        expected = self._shard_bytes.get(self._shards[shard])
        try:
            stat = os.stat(path)
        except OSError:
            return False
        if expected is None or stat.st_size != expected:
            return False
        with self._lock:
            current = self._open.get(shard)
            if current is stale and (stat.st_dev, stat.st_ino) != stale.identity:
                try:
                    self._open[shard] = _OpenShard(path)
                except OSError:
                    return False
                self._retired.append(stale)
        return True


def _close_all(open_files: dict[int, _OpenShard], retired: list[_OpenShard]) -> None:
    for opened in [*open_files.values(), *retired]:
        os.close(opened.fd)


def half_boxes(boxes: np.ndarray, widths: np.ndarray, heights: np.ndarray) -> np.ndarray:
    """Windows ``(x, y, width, height)`` of images ``widths x heights`` as windows of
    their half-scale copies (``ceil(width / 2) x ceil(height / 2)``): edges halved,
    an odd edge moved out by half a pixel of the copy, clipped to the copy."""
    x, y, w, h = (boxes[:, i].astype(np.int64) for i in range(4))
    x0, y0 = x // 2, y // 2
    x1 = np.minimum((x + w + 1) // 2, (np.asarray(widths, dtype=np.int64) + 1) // 2)
    y1 = np.minimum((y + h + 1) // 2, (np.asarray(heights, dtype=np.int64) + 1) // 2)
    return np.stack([x0, y0, x1 - x0, y1 - y0], axis=1).astype(np.int32)


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
            splits[str(split)] = _open_split(root, str(split), info)
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
    """The rows of ``<split>/index.parquet`` (``columns`` of them, or all). The
    columns of the half-scale copies, where an index lacks them (written before
    them), come as ``-1`` / ``0``: no copies.

    Raises:
        DataError: the file is missing, unreadable, or a column has another type than
            ``INDEX_SCHEMA`` says.
    """
    path = index_path(root, split)
    if not path.is_file():
        raise DataError(f"{path}: missing index of split {split!r}")
    names = list(columns) if columns is not None else INDEX_SCHEMA.names
    try:
        present = set(pq.read_schema(path).names)
        absent = [c for c in HALF_COLUMNS if c in names and c not in present]
        table = pq.read_table(path, columns=[c for c in names if c not in absent])
    except Exception as e:  # pyarrow raises several unrelated types for bad files
        raise DataError(f"{path}: not a readable index ({str(e).splitlines()[0]})") from e
    for column in absent:
        fill = -1 if column == "half_offset" else 0
        table = table.append_column(INDEX_SCHEMA.field(column), pa.array(np.full(table.num_rows, fill, np.int64)))
    table = table.select(names)
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


@dataclass(frozen=True)
class TarScan:
    """What a tolerant walk over a tar found.

    Attributes:
        members: member name -> (data offset, size) of every readable file member.
        damaged: ``(start, end)`` byte ranges where a member header should be but
            none is readable (bad checksum); the walk resumed at the next valid header.
    """

    members: dict[str, tuple[int, int]]
    damaged: list[tuple[int, int]]

    def damage_within(self, start: int, end: int) -> bool:
        """True when a damaged range overlaps bytes ``start..end``."""
        return any(begin < end and start < stop for begin, stop in self.damaged)


def scan_tar(path: Path) -> TarScan:
    """Members of the tar at ``path``, walking past damaged member headers instead of
    stopping at the first (as :func:`tar_members` and most tar readers do), so one bad
    header costs one member, not every member after it.

    Raises:
        DataError: not a readable tar at all.
    """
    members, damaged, expected = {}, [], 0
    try:
        with tarfile.open(path, ignore_zeros=True) as tar:  # ignore_zeros: resync block by block
            for member in tar:
                if member.offset > expected:
                    damaged.append((expected, member.offset))
                if member.isfile():
                    members[member.name] = (member.offset_data, member.size)
                expected = member.offset_data + -(-member.size // _BLOCK) * _BLOCK
    except (OSError, tarfile.TarError) as e:
        raise DataError(f"{path}: not a readable tar ({e})") from e
    if _nonzero_after(path, expected):
        damaged.append((expected, path.stat().st_size))
    return TarScan(members, damaged)


def _nonzero_after(path: Path, offset: int) -> bool:
    """True when the tar holds anything but end-of-archive zeros after ``offset``."""
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 20):
            if chunk.strip(b"\0"):
                return True
    return False


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


def _open_split(root: Path, split: str, info: dict[str, Any]) -> SplitIndex:
    path, expected = index_path(root, split), info.get("num_samples")
    table = read_index(root, split, ["key", "label", "shard", "offset", "size", "width", "height", *HALF_COLUMNS])
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
        half_offsets=table.column("half_offset").to_numpy().astype(np.int64),
        half_sizes=table.column("half_size").to_numpy().astype(np.int64),
    )
    _check_extents(root, path, columns, shards)
    _check_image_sizes(path, columns)
    _check_half_copies(path, columns)
    shard_bytes = {str(entry["path"]): int(entry["bytes"]) for entry in info.get("shards", []) if "bytes" in entry}
    return SplitIndex(root, split, columns, shards, shard_bytes)


def _check_extents(root: Path, path: Path, cols: _Columns, shards: list[str]) -> None:
    for shard_id, shard in enumerate(shards):
        file = root / shard
        if not file.is_file():
            raise DataError(f"{path}: shard {shard} is missing")
        mine = cols.shard_ids == shard_id
        ends = np.maximum(cols.offsets[mine] + cols.sizes[mine], cols.half_offsets[mine] + cols.half_sizes[mine])
        end = int(ends.max(initial=0))
        if end > file.stat().st_size:
            raise DataError(f"{file}: {file.stat().st_size} bytes, index points to byte {end}")


def _check_image_sizes(path: Path, cols: _Columns) -> None:
    """Crop windows are drawn from the index's sizes; a row without one cannot be served."""
    bad = np.flatnonzero((cols.widths < 1) | (cols.heights < 1))
    if len(bad):
        raise DataError(f"{path}: no image size for key {cols.keys[int(bad[0])]!r} ({len(bad)} rows)")


def _check_half_copies(path: Path, cols: _Columns) -> None:
    """A half-scale copy the index locates lies in its tar (``_check_extents`` has the
    end); a row's columns of the copies either locate one or say there is none."""
    bad = np.flatnonzero((cols.half_sizes < 0) | ((cols.half_sizes > 0) & (cols.half_offsets < 0)))
    if len(bad):
        row = int(bad[0])
        raise DataError(f"{path}: key {cols.keys[row]!r} has half_offset {int(cols.half_offsets[row])}, "
                        f"half_size {int(cols.half_sizes[row])} ({len(bad)} rows)")
