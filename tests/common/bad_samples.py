"""Shard directories with one bad sample in them, made from real shards: a JPEG whose
scan cannot be decoded, or an index row that claims a huge image."""

from __future__ import annotations

import shutil
from pathlib import Path

import pyarrow.parquet as pq

from shards.layout import index_path, sample_checksum
from shards.writers import write_index
from tests.common.shards import seal_index

__all__ = ["break_scan", "broken_scan", "claim_size", "copy_shards", "index_as_stored"]

_SOS = b"\xff\xda"  # start-of-scan marker
_UNDEFINED_TABLES = 0x33  # DC and AC Huffman table 3: the sample JPEGs define 0 and 1 only


def copy_shards(shards: Path, dest: Path) -> Path:
    """A private copy of a shard directory (tests change it)."""
    return Path(shutil.copytree(shards, dest))


def broken_scan(data: bytes) -> bytes:
    """``data`` (a baseline JPEG) with its scan asking for Huffman tables the file does
    not define (see :func:`break_scan`): same size and markers, refused by every
    decoder."""
    sos = data.index(_SOS)
    # FFDA, length (2 bytes), component count, then (id, tables) per component.
    return data[:sos + 6] + bytes([_UNDEFINED_TABLES]) + data[sos + 7:]


def break_scan(root: Path, split: str, row: int) -> str:
    """Make sample ``row`` of ``split`` undecodable in place and return its key.

    The JPEG keeps its size, its markers and its end marker (so the daemon's start-up
    checks pass and a header parse succeeds); its scan asks for Huffman tables the
    file does not define, which every decoder (libjpeg-turbo in DALI and PIL, nvJPEG)
    refuses. DALI's CPU decoder does not fail on corrupt entropy-coded bytes alone:
    it decodes them to wrong pixels with a warning. The index's checksum is recorded
    for the broken bytes (:func:`index_as_stored`): the sample reaches the decoder.
    """
    sample = pq.read_table(index_path(root, split)).to_pylist()[row]
    with open(root / sample["shard"], "r+b") as f:
        f.seek(sample["offset"])
        broken = broken_scan(f.read(sample["size"]))
        f.seek(sample["offset"])
        f.write(broken)
    index_as_stored(root, split)
    return str(sample["key"])


def index_as_stored(root: Path, split: str) -> None:
    """Record in the index (and the manifest's ``index_sha256``) the checksums of the
    bytes the split's tars hold now, as if samples damaged in place had been sharded
    that way: their damage then reaches the decoder, which is what tests of undecodable
    samples are about, instead of the reader's checksum check."""
    path = index_path(root, split)
    columns = pq.read_table(path).to_pydict()
    for name, offset, size in (("checksum", "offset", "size"), ("half_checksum", "half_offset", "half_size")):
        columns[name] = [_checksum_at(root / shard, at, count) if count > 0 else 0
                         for shard, at, count in zip(columns["shard"], columns[offset], columns[size])]
    write_index(path, columns)
    seal_index(root, split)


def _checksum_at(tar: Path, offset: int, size: int) -> int:
    with open(tar, "rb") as f:
        f.seek(offset)
        return sample_checksum(f.read(size))


def claim_size(root: Path, split: str, row: int, width: int, height: int) -> str:
    """Rewrite the index so that sample ``row`` of ``split`` claims ``width`` x
    ``height`` pixels (a decompression bomb, as far as the index says); return its key."""
    path = index_path(root, split)
    columns = pq.read_table(path).to_pydict()
    columns["width"][row], columns["height"][row] = width, height
    write_index(path, columns)
    seal_index(root, split)
    return str(columns["key"][row])
