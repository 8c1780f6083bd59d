"""The LMDB format (Caffe ``Datum`` values, read by DALI's ``readers.caffe``) is built
after a split's tars are final, by copying their samples in order: the tars are the
primary output and a killed run resumes them shard by shard; the LMDB is rebuilt
whole from them."""

from __future__ import annotations

from pathlib import Path

from sharder.split_writer import ShardRecord
from shards.layout import LMDB_DIR
from shards.manifest import LmdbEntry
from shards.writers import LmdbWriter, Sample, file_sha256

__all__ = ["copy_to_lmdb"]


def copy_to_lmdb(out: Path, tar_root: Path, split: str, records: list[ShardRecord]) -> LmdbEntry:
    """Build ``OUT/<split>/lmdb`` from the finished tars (same samples, same order).

    Returns:
        The split's ``lmdb`` manifest entry (path, samples, bytes, sha256).
    """
    total = sum(rec.bytes for rec in records)
    # Map size is only an upper bound of the file (Datum overhead + B-tree pages).
    with LmdbWriter(out / split / LMDB_DIR, map_size_bytes=2 * total + (64 << 20)) as writer:
        for rec in (r for r in records if r.path):
            with open(tar_root / rec.path, "rb") as tar:
                for key, label, offset, size, _, width, height, *_ in rec.rows:  # the image, not its copy
                    tar.seek(offset)
                    writer.write(Sample(key, label, tar.read(size), width, height))
        writer.finish()
    data = out / split / LMDB_DIR / "data.mdb"
    samples = sum(len(rec.rows) for rec in records)
    return LmdbEntry(path=f"{split}/{LMDB_DIR}", samples=samples, bytes=data.stat().st_size, sha256=file_sha256(data))
