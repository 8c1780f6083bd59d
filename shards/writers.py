"""Shard writers: one abstract writer, thin formats.

A writer is a context manager: ``write(sample)`` any number of times, then
``finish()``, which makes the output durable and visible under its final name
(write to a temporary name, fsync, rename). Leaving the ``with`` block without
``finish()`` (an error, Ctrl-C) removes the temporary output, so a partial file is
never seen under a final name.

A write that fails (a full disk, a quota, a read-only file system) raises an
``OSError`` whose ``filename`` is the final name of what was being written, whichever
call failed (a buffered ``write`` or ``close`` names no file; pyarrow and LMDB name
none), so that the caller can tell the user which file could not be written.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tarfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any, NamedTuple

import lmdb
import pyarrow as pa
import pyarrow.parquet as pq

from shards.datum import encode_datum
from shards.layout import INDEX_VERSION, file_sha256, fsync_dir, index_schema, sample_checksum
from shards.manifest import Manifest

__all__ = [
    "LmdbWriter",
    "Sample",
    "ShardWriter",
    "Stored",
    "TarShardWriter",
    "file_sha256",
    "fsync_dir",
    "naming_errors",
    "tar_member_bytes",
    "ustar_header",
    "write_index",
    "write_json_atomic",
    "write_manifest",
]

_BLOCK = 512
_END_OF_ARCHIVE = b"\0" * (2 * _BLOCK)
_ZEROS = bytes(_BLOCK)


@dataclass(frozen=True)
class Sample:
    """One accepted sample on its way into the shards."""

    key: str
    label: int
    data: bytes
    width: int
    height: int
    half: bytes = b""  # its half-scale copy (``feeder shard --half-copies``), or none


class Stored(NamedTuple):
    """Where a writer put a sample's JPEG bytes (and its half-scale copy's: offset
    -1 and size 0 where it has none or the format keeps none), and their checksums
    (``shards.layout.sample_checksum``; 0 for no copy)."""

    offset: int
    size: int
    half_offset: int = -1
    half_size: int = 0
    checksum: int = 0
    half_checksum: int = 0


@contextmanager
def naming_errors(path: Path) -> Iterator[None]:
    """An ``OSError`` (or an LMDB error with a system error code) raised inside is
    raised again as an ``OSError`` of the same errno naming ``path``, the final name of
    the output being written: the errno's own text, the original as its cause. Errors
    without an errno pass unchanged.

    Raises:
        OSError: as described, with ``filename`` ``str(path)``.
    """
    try:
        yield
    except OSError as e:
        if not e.errno or e.filename == str(path):
            raise
        raise OSError(e.errno, os.strerror(e.errno), str(path)) from e
    except lmdb.Error as e:
        code = getattr(e, "code", 0)  # > 0: a system errno (ENOSPC, EIO); < 0: LMDB's own
        if not isinstance(code, int) or code <= 0:
            raise
        raise OSError(code, os.strerror(code), str(path)) from e


def _padded(size: int) -> int:
    return -(-size // _BLOCK) * _BLOCK


def _ustar_template() -> bytes:
    info = tarfile.TarInfo("")
    info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = 0, 0o644, 0, 0, "", ""
    return info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")


# Every member header is the same but for name, size and checksum (POSIX ustar:
# name at 0..100, size at 124..136 as 11 octal digits + NUL, checksum at 148..156).
# Filling in a template is ~20x faster than tarfile.TarInfo.tobuf, which dominated
# the writer's time for pass-through JPEGs; tests compare both byte for byte.
_USTAR_TEMPLATE = _ustar_template()
_CHECKSUM_BLANK = b" " * 8


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte ustar header of a regular file ``name`` (ASCII, < 100 bytes).

    Raises:
        ValueError: a name that does not fit, or a size over 8 GiB.
    """
    encoded = name.encode("ascii")
    if len(encoded) >= 100 or size >= 8**11:
        raise ValueError(f"tar member {name!r} of {size} bytes does not fit a ustar header")
    header = bytearray(_USTAR_TEMPLATE)
    header[0:100] = encoded.ljust(100, b"\0")
    header[124:136] = b"%011o\0" % size
    header[148:156] = _CHECKSUM_BLANK
    header[148:155] = b"%06o\0" % sum(header)
    return bytes(header)


def tar_member_bytes(data_size: int) -> int:
    """Bytes a tar member with ``data_size`` bytes of data occupies (header + padding)."""
    return _BLOCK + _padded(data_size)


class ShardWriter(ABC):
    """Base of the formats: temporary output until ``finish()``."""

    def __init__(self, final_path: Path) -> None:
        self.final_path = final_path
        self.temp_path = final_path.with_name(final_path.name + ".tmp")
        self.finished = False

    def __enter__(self) -> ShardWriter:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None, tb: TracebackType | None) -> None:
        if not self.finished:
            self.abort()

    @abstractmethod
    def write(self, sample: Sample) -> Stored:
        """Add ``sample``; returns where its bytes are in the output."""

    @abstractmethod
    def finish(self) -> None:
        """Flush, fsync and move the output to its final name."""

    @abstractmethod
    def abort(self) -> None:
        """Drop the temporary output."""


class TarShardWriter(ShardWriter):
    """One WebDataset tar (``<key>.jpg`` + ``<key>.cls``, then ``<key>.half.jpg``
    where the sample has a half-scale copy) and its DALI ``.idx`` file.

    Tar headers are fixed (mtime 0, uid/gid 0, no user names, mode 0644), so the same
    samples always give the same bytes.
    """

    def __init__(self, final_path: Path) -> None:
        super().__init__(final_path)
        self.index_path = final_path.with_suffix(".idx")
        with naming_errors(final_path):
            self._file = open(self.temp_path, "wb")
        self._hash = hashlib.sha256()
        self._lines: list[str] = []
        self.bytes_written = 0
        self.samples = 0
        self.sha256 = ""

    def bytes_after(self, data_size: int, half_size: int = 0) -> int:
        """Size of the finished tar if a sample of ``data_size`` JPEG bytes (and a
        half-scale copy of ``half_size``, 0: none) were added."""
        label_size = 8  # generous: a label is at most a few ASCII digits
        half = tar_member_bytes(half_size) if half_size else 0
        return (self.bytes_written + tar_member_bytes(data_size) + tar_member_bytes(label_size) + half
                + len(_END_OF_ARCHIVE))

    def _member(self, name: str, data: bytes) -> tuple[int, int]:
        header = ustar_header(name, len(data))
        offset = self.bytes_written + len(header)
        for chunk in (header, data, _ZEROS[: _padded(len(data)) - len(data)]):  # no concatenated copy
            self._put(chunk)
        return offset, len(data)

    def _put(self, chunk: bytes) -> None:
        with naming_errors(self.final_path):
            self._file.write(chunk)
        self._hash.update(chunk)
        self.bytes_written += len(chunk)

    def write(self, sample: Sample) -> Stored:
        label = str(sample.label).encode("ascii")
        jpg = self._member(f"{sample.key}.jpg", sample.data)
        cls = self._member(f"{sample.key}.cls", label)  # right after .jpg: see shards.members.label_offset
        # DALI index line: "<ext> <data offset> <size> <member name>" per component.
        line = f"jpg {jpg[0]} {jpg[1]} {sample.key}.jpg cls {cls[0]} {cls[1]} {sample.key}.cls"
        half = (-1, 0)
        if sample.half:
            half = self._member(f"{sample.key}.half.jpg", sample.half)
            line += f" half.jpg {half[0]} {half[1]} {sample.key}.half.jpg"
        self._lines.append(line)
        self.samples += 1
        half_checksum = sample_checksum(sample.half) if sample.half else 0
        return Stored(*jpg, *half, sample_checksum(sample.data), half_checksum)

    def finish(self) -> None:
        self._put(_END_OF_ARCHIVE)
        with naming_errors(self.final_path):
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
        self.sha256 = self._hash.hexdigest()
        lines = f"v1.2 {len(self._lines)}\n" + "".join(line + "\n" for line in self._lines)
        _write_durably(self.index_path, lambda temp: temp.write_bytes(lines.encode("ascii")))
        with naming_errors(self.final_path):
            os.replace(self.temp_path, self.final_path)
            fsync_dir(self.final_path.parent)
        self.finished = True

    def abort(self) -> None:
        with suppress(OSError):  # its buffer may not flush (a full disk): dropped anyway
            self._file.close()
        self.temp_path.unlink(missing_ok=True)


class LmdbWriter(ShardWriter):
    """An LMDB environment of Caffe ``Datum`` values (encoded JPEG + label).

    Keys are the sample keys, which start with the zero-padded write position, so the
    key order LMDB readers (Caffe, DALI ``readers.caffe``) iterate in is the shuffled
    write order.
    """

    _COMMIT_EVERY = 1000  # samples per write transaction, as Caffe's convert_imageset

    def __init__(self, final_path: Path, map_size_bytes: int) -> None:
        super().__init__(final_path)
        shutil.rmtree(self.temp_path, ignore_errors=True)
        with naming_errors(final_path):
            # lock=False: no lock.mdb beside data.mdb; this writer is the only user.
            self._env = lmdb.open(str(self.temp_path), map_size=map_size_bytes, subdir=True, lock=False)
            self._txn = self._env.begin(write=True)
        self._pending = 0

    def write(self, sample: Sample) -> Stored:
        datum = encode_datum(sample.data, sample.label, sample.width, sample.height)
        with naming_errors(self.final_path):
            self._txn.put(sample.key.encode("ascii"), datum, append=True)
            self._pending += 1
            if self._pending >= self._COMMIT_EVERY:
                self._txn.commit()
                self._txn, self._pending = self._env.begin(write=True), 0
        # The full image only: Caffe readers know no copies.
        return Stored(-1, len(sample.data), checksum=sample_checksum(sample.data))

    def finish(self) -> None:
        with naming_errors(self.final_path):
            self._txn.commit()
            self._env.sync(True)
            self._env.close()
            if self.final_path.exists():
                shutil.rmtree(self.final_path)
            os.replace(self.temp_path, self.final_path)
            fsync_dir(self.final_path.parent)
        self.finished = True

    def abort(self) -> None:
        with suppress(lmdb.Error):  # a transaction a failed commit already ended
            self._txn.abort()
        self._env.close()
        shutil.rmtree(self.temp_path, ignore_errors=True)


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file, fsync and rename.

    Args:
        path: final file name.
        obj: anything ``json.dump`` takes.
        indent: as in ``json.dump``; None for compact machine-only files.

    Raises:
        OSError: the file cannot be written (names ``path``).
    """
    text = json.dumps(obj, indent=indent) + "\n"
    _write_durably(path, lambda temp: temp.write_bytes(text.encode("utf-8")))


def write_manifest(path: Path, manifest: Manifest) -> None:
    """Write ``manifest`` to ``path`` (``OUT/manifest.json``) as :func:`write_json_atomic`
    does: the only writer of manifests, read back by :func:`shards.manifest.read_manifest`.

    Raises:
        OSError: the file cannot be written (names ``path``).
    """
    write_json_atomic(path, manifest.to_json())


def _write_durably(path: Path, write: Callable[[Path], Any]) -> None:
    """``write`` a temporary file beside ``path`` (it gets that file's name), fsync it
    and rename it to ``path``; the temporary file is removed if any of that fails.

    Raises:
        OSError: naming ``path`` (:func:`naming_errors`).
    """
    temp = path.with_name(path.name + ".tmp")
    try:
        with naming_errors(path):
            write(temp)
            with open(temp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(temp, path)
            fsync_dir(path.parent)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_index(path: Path, columns: dict[str, list[Any]], version: int = INDEX_VERSION) -> None:
    """Write a split's ``index.parquet`` durably (a temporary file, fsync, rename),
    its format version in the schema metadata.

    Args:
        path: final file name.
        columns: column name -> one value per sample; the columns of
            ``index_schema(version)`` (others are left out).
        version: the index format (:mod:`shards.layout`); an older one only for a
            reader that knows no later one.

    Raises:
        ValueError: a version this code does not know.
        KeyError: a column of that version is missing.
        OSError: the file cannot be written (names ``path``).
    """
    schema = index_schema(version)
    table = pa.table({name: columns[name] for name in schema.names}, schema=schema)
    _write_durably(path, lambda temp: pq.write_table(table, temp))
