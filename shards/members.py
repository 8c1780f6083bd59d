"""The members of a shard's files as the reader and ``feeder verify`` see them: a
tar's members (strictly, or walking past damaged headers), a DALI ``.idx`` file's
lines, where a sample's label lies, and an LMDB value (:mod:`shards.layout`)."""

from __future__ import annotations

import tarfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import lmdb

from core.errors import DataError
from shards.datum import decode_datum

if TYPE_CHECKING:
    from shards.remote_root import ObjectPath

__all__ = [
    "TarScan",
    "idx_members",
    "label_offset",
    "read_lmdb_sample",
    "scan_tar",
    "tar_members",
]

_BLOCK = 512  # tar block size


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


def scan_tar(path: Path | ObjectPath) -> TarScan:
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


def _nonzero_after(path: Path | ObjectPath, offset: int) -> bool:
    """True when the tar holds anything but end-of-archive zeros after ``offset``."""
    with open(path, "rb") as f:
        f.seek(offset)
        while chunk := f.read(1 << 20):
            if chunk.strip(b"\0"):
                return True
    return False


def idx_members(path: Path | ObjectPath) -> dict[str, tuple[int, int]]:
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
