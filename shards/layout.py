"""The on-disk layout of a shard directory: the contract between ``feeder shard``,
``feeder verify``, the daemon and tools this project did not write.

::

    OUT/manifest.json                      versioned, see ``MANIFEST_NAME``
    OUT/<split>/shard-NNNNNN.tar           WebDataset: <key>.jpg, <key>.cls (ASCII int),
                                           <key>.half.jpg (with --half-copies)
    OUT/<split>/shard-NNNNNN.idx           DALI webdataset index of the tar beside it
    OUT/<split>/index.parquet              one row per sample, ``INDEX_SCHEMA``
    OUT/<split>/lmdb/                      optional, Caffe Datum values (DALI readers.caffe)

``index.parquet`` rows are in write order (the globally shuffled order). ``shard`` is
the tar's path relative to OUT (``train/shard-000000.tar``); ``offset`` / ``size`` locate
the JPEG bytes of the sample inside that tar (the member's data, not its header), so a
reader can read them with one ``pread``. ``source`` is the input path relative to SRC.
``half_offset`` / ``half_size`` locate the sample's half-scale copy the same way
(``feeder shard --half-copies``: the image decoded at DCT scale 1/2, ``ceil(width /
2) x ceil(height / 2)`` pixels, re-encoded as a JPEG with the same restart markers),
``-1`` / ``0`` where it has none; indexes of version 1 lack them, and read as having no
copies. A crop window at least twice the output on both sides is decoded from the
copy: a quarter of the entropy decoding for the same output resolution (see
:meth:`shards.reader.SplitIndex.read_windows`).

Index format versions (``INDEX_VERSION``), each adding columns to the one before:

1. ``key, label, shard, offset, size, source, width, height``;
2. ``+ half_offset, half_size``;
3. ``+ checksum, half_checksum``: the xxh3_64 hash (``sample_checksum``, an unsigned
   64-bit integer) of the sample's stored JPEG bytes, and of its half-scale copy's
   (``0`` where it has none). The reader checks it on every read and refuses bytes
   that differ (:class:`core.errors.SampleCorrupt`, naming the tar and the key), so a
   tar changed in place after sharding (``dd conv=notrunc``, ``rsync --inplace``) is
   never served as another image. xxh3_64 over CRC32C (``google-crc32c``, hardware
   CRC instructions): on 50 / 100 / 150 KB buffers it takes 1.1 / 2.2 / 3.1 us in
   cache (45-49 GB/s) against 2.3 / 4.4 / 6.4 us (22-24 GB/s), and 1.6 / 4.0 / 8.2
   us against 3.6 / 7.2 / 11.2 us out of cache (2 vCPUs, AMD EPYC); 64 bits also
   make a chance match of damaged bytes negligible. Checking costs the daemon 1.5 to
   3 CPU us per image of the sample data (41.5 KB on average; reads alone 8-10 us),
   0.4 to 1 % of the 0.3-0.4 ms its CPU path spends on a 224 px image.

The version is in the Arrow schema metadata of ``index.parquet`` (key
``INDEX_VERSION_KEY``, ASCII digits) and, for people and tools reading the manifest
only, in the split's ``index_version``; the two must agree. An index without it
(written before versions were recorded) is version 2 when it has the columns of the
half-scale copies, else 1. The reader reads every version up to ``INDEX_VERSION``
(columns a version lacks come as "none": no copy, no checksum, so such samples are
served unchecked, as before) and refuses a later one, naming the file and both
versions: its columns may mean what this reader would get wrong. (The manifest has a
version of its own, apart from the index's: ``shards.manifest.FORMAT_VERSION``.)

``manifest.json`` says what a shard directory holds; it is written last.

Shape (``FORMAT_VERSION`` 1), record by record (:mod:`shards.manifest` has one
frozen dataclass per record, its fields in this order, which is the order written);
``?`` marks a key that may be absent::

    Manifest
      format_version   int, 1
      layout           "ilsvrc" | "folders"
      source           str, SRC as given (a resolved path or a URL)
      classes          [str], sorted class names; label = index in this list
      splits           {split name: SplitEntry}, at least one
      options          {...}, the options that decide the bytes (ShardConfig.options)
    SplitEntry
      num_samples      int
      accepted         int
      rejected         int
      reencoded?       int
      ignored          int
      inputs           int
      per_class        {class name: accepted count}
      index            str, "train/index.parquet"
      index_version?   int, see above
      shards           [ShardEntry], empty for an LMDB-only split
      rejects          [SkippedInput]
      skipped_links?   [SkippedInput]
      empty_classes?   [str]
      index_sha256?    str
      lmdb?            LmdbEntry, with --formats lmdb only
    ShardEntry
      path             str, "train/shard-000000.tar"
      index            str, its DALI index, "train/shard-000000.idx"
      samples          int
      bytes            int
      sha256           str
    LmdbEntry
      path             str, "train/lmdb"
      samples          int
      bytes            int, of its data.mdb
      sha256           str, of its data.mdb
    SkippedInput
      source           str, the input's path under SRC
      reason           str

Keys a record does not declare are kept as they are (read and written back).

``accepted + rejected == inputs``; ``reencoded`` counts accepted inputs stored as a new
RGB JPEG (odd formats, ``--max-side-px``, ``--quality``) rather than kept as it came
(with restart markers added losslessly, ``options.restart_interval``). A
directory under SRC that could not be listed is one of the ``rejects`` (its path, and
the reason). ``skipped_links`` are the symbolic links under SRC not followed, because
they lead to a folder already walked or above one (a loop) or to a file already
sharded; ``empty_classes`` are the class folders of the split with no image file (the
class keeps its label, with 0 samples). Both were added without a version change:
manifests written before them lack the two keys; the reader and ``feeder verify``
do not use them. So were ``reencoded``, ``index_version`` (the index's own version
is the one read) and ``index_sha256``; those keys stay optional in version 1, and any
key added from now on comes with a new ``FORMAT_VERSION`` (``docs/design.md``,
"Adding a manifest key").
``options.half_copies`` says whether half-scale copies were made.

Writers of all of this are in :mod:`shards.writers`; the one reader is :mod:`shards.reader`
(the manifest through :mod:`shards.manifest`, the indexes through :mod:`shards.index`, the
members of tars, ``.idx`` files and LMDB values through :mod:`shards.members`, open tars
through :mod:`shards.tars`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, overload

import numpy as np
import pyarrow as pa
import xxhash

if TYPE_CHECKING:
    from shards.remote_root import ObjectPath

__all__ = [
    "CHECKSUM_COLUMNS",
    "HALF_COLUMNS",
    "INDEX_NAME",
    "INDEX_SCHEMA",
    "INDEX_VERSION",
    "INDEX_VERSION_KEY",
    "LMDB_DIR",
    "MANIFEST_NAME",
    "file_sha256",
    "fsync_dir",
    "index_path",
    "index_schema",
    "sample_checksum",
    "shard_name",
]

MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.parquet"
LMDB_DIR = "lmdb"

INDEX_VERSION = 3  # the index format this code writes, and the latest it reads
INDEX_VERSION_KEY = b"feeder.index_version"  # in the Arrow schema metadata of index.parquet

_BASE_FIELDS = [
    ("key", pa.string()),
    ("label", pa.int64()),
    ("shard", pa.string()),
    ("offset", pa.int64()),
    ("size", pa.int64()),
    ("source", pa.string()),
    ("width", pa.int32()),
    ("height", pa.int32()),
]
# Columns an index may lack (version 1): no sample has a half-scale copy.
HALF_COLUMNS = ("half_offset", "half_size")
# Columns an index may lack (versions 1 and 2): its samples are served unchecked.
CHECKSUM_COLUMNS = ("checksum", "half_checksum")
_ADDED_FIELDS = {
    2: [("half_offset", pa.int64()), ("half_size", pa.int64())],
    3: [("checksum", pa.uint64()), ("half_checksum", pa.uint64())],
}


def index_schema(version: int = INDEX_VERSION) -> pa.Schema:
    """The columns of an index of format ``version`` (1 to ``INDEX_VERSION``), with
    the version in its metadata.

    Raises:
        ValueError: a version this code does not know.
    """
    if not 1 <= version <= INDEX_VERSION:
        raise ValueError(f"index format version {version}: this code knows 1 to {INDEX_VERSION}")
    fields = _BASE_FIELDS + [f for v in range(2, version + 1) for f in _ADDED_FIELDS[v]]
    return pa.schema(fields, metadata={INDEX_VERSION_KEY: str(version).encode("ascii")})


INDEX_SCHEMA = index_schema()


def sample_checksum(data: bytes | np.ndarray) -> int:
    """The ``checksum`` of stored bytes ``data`` (xxh3_64, seed 0, as an unsigned int)."""
    return xxhash.xxh3_64_intdigest(data if isinstance(data, bytes) else data.data)


def shard_name(number: int, suffix: str = ".tar") -> str:
    """``shard-000042.tar`` for shard 42 (``suffix=".idx"`` for its DALI index)."""
    return f"shard-{number:06d}{suffix}"


@overload
def index_path(root: Path, split: str) -> Path: ...
@overload
def index_path(root: ObjectPath, split: str) -> ObjectPath: ...
def index_path(root: Path | ObjectPath, split: str) -> Path | ObjectPath:
    """Path of the Parquet index of ``split`` under shard directory ``root``."""
    return root / split / INDEX_NAME


def file_sha256(path: str | os.PathLike[str]) -> str:
    """Hex sha256 of the file at ``path``, read in 1 MiB pieces (a file of any size)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make the entries of directory ``path`` (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
