"""The format's writers and its one reader cannot drift: samples written with
``shards.writers`` come back unchanged through ``shards.reader``."""

from __future__ import annotations

from pathlib import Path

import lmdb
import numpy as np
import pytest

from shards.index import read_index, read_manifest
from shards.layout import (
    INDEX_VERSION,
    LMDB_DIR,
    MANIFEST_NAME,
    index_path,
    sample_checksum,
    shard_name,
)
from shards.manifest import FORMAT_VERSION, Manifest, ShardEntry, SplitEntry
from shards.members import idx_members, label_offset, read_lmdb_sample, tar_members
from shards.reader import ShardDataset
from shards.writers import LmdbWriter, Sample, TarShardWriter, file_sha256, write_index, write_manifest


def _samples(count: int) -> list[Sample]:
    rng = np.random.default_rng(0)
    # Odd sizes on purpose: member data is padded to 512-byte blocks.
    # Every third sample has a half-scale copy (``--half-copies``), so both kinds mix.
    return [Sample(f"s{i:03d}", int(rng.integers(0, 7)), rng.bytes(int(rng.integers(1, 3000))), 10 + i, 20 + i,
                   rng.bytes(int(rng.integers(1, 900))) if i % 3 == 0 else b"")
            for i in range(count)]


def _write(root: Path, samples: list[Sample], version: int = INDEX_VERSION) -> None:
    split = root / "train"
    split.mkdir(parents=True)
    rows: dict[str, list] = {k: [] for k in ("key", "label", "shard", "offset", "size", "source", "width", "height",
                                             "half_offset", "half_size", "checksum", "half_checksum")}
    shards = []
    for number, part in enumerate((samples[:5], samples[5:])):
        tar = split / shard_name(number)
        with TarShardWriter(tar) as writer:
            for sample in part:
                stored = writer.write(sample)
                for column, value in zip(rows, (sample.key, sample.label, f"train/{tar.name}", stored.offset,
                                                stored.size, f"src/{sample.key}.jpg", sample.width, sample.height,
                                                stored.half_offset, stored.half_size, stored.checksum,
                                                stored.half_checksum)):
                    rows[column].append(value)
            writer.finish()
        shards.append(ShardEntry(path=f"train/{tar.name}", index=f"train/{tar.with_suffix('.idx').name}",
                                 samples=len(part), bytes=tar.stat().st_size, sha256=file_sha256(tar)))
    with LmdbWriter(split / LMDB_DIR, map_size_bytes=1 << 24) as lmdb_writer:
        for sample in samples:
            lmdb_writer.write(sample)
        lmdb_writer.finish()
    write_index(index_path(root, "train"), rows, version)
    n = len(samples)
    entry = SplitEntry(num_samples=n, accepted=n, rejected=0, ignored=0, inputs=n, per_class={},
                       index="train/index.parquet", shards=tuple(shards), rejects=())
    write_manifest(root / MANIFEST_NAME, Manifest(format_version=FORMAT_VERSION, layout="folders", source="src",
                                                  classes=tuple(str(c) for c in range(7)),
                                                  splits={"train": entry}, options={}))


def test_written_samples_read_back_unchanged(tmp_path: Path) -> None:
    samples = _samples(12)
    _write(tmp_path, samples)

    assert read_manifest(tmp_path).splits["train"].num_samples == 12
    split = ShardDataset.open("t", tmp_path).splits["train"]
    assert split.keys == [s.key for s in samples]
    assert split.labels.tolist() == [s.label for s in samples]
    assert [split.read(i).tobytes() for i in range(12)] == [s.data for s in samples]
    assert split.half_copies.tolist() == [bool(s.half) for s in samples]
    assert [split.read(i, half=True).tobytes() for i in range(0, 12, 3)] == [s.half for s in samples[::3]]
    assert [p.name for p in split.shard_paths] == [shard_name(0), shard_name(1)]

    table = read_index(tmp_path, "train")
    assert table.column("width").to_pylist() == [s.width for s in samples]
    assert table.column("checksum").to_pylist() == [sample_checksum(s.data) for s in samples]
    assert table.column("half_checksum").to_pylist() == [sample_checksum(s.half) if s.half else 0 for s in samples]
    for path in split.shard_paths:
        members = tar_members(path)
        assert idx_members(path.with_suffix(".idx")) == members
        raw = path.read_bytes()
        for key, (offset, size) in members.items():
            if key.endswith(".half.jpg"):
                assert raw[offset : offset + size] == samples[int(key[1:4])].half
            elif key.endswith(".jpg"):
                label = raw[label_offset(offset, size):].split(b"\0", 1)[0]
                assert members[key[:-4] + ".cls"][0] == label_offset(offset, size)
                assert int(label) == samples[int(key[1:4])].label

    with lmdb.open(str(tmp_path / "train" / LMDB_DIR), readonly=True, lock=False) as env:
        for sample in samples:  # the images only: Caffe readers know no copies
            assert read_lmdb_sample(env, sample.key) == (sample.data, sample.label)
        assert read_lmdb_sample(env, "absent") == (b"", -1)


@pytest.mark.parametrize("version", range(1, INDEX_VERSION + 1))
def test_an_index_of_each_version_reads_back(tmp_path: Path, version: int) -> None:
    samples = _samples(12)
    _write(tmp_path, samples, version)
    split = ShardDataset.open("t", tmp_path).splits["train"]
    assert split.index_version == version
    assert split.keys == [s.key for s in samples]
    assert [split.read(i).tobytes() for i in range(12)] == [s.data for s in samples]
    copies = version >= 2  # version 1 has no columns for them: no sample has a copy
    assert split.half_copies.tolist() == [bool(s.half) and copies for s in samples]
    table = read_index(tmp_path, "train")
    assert table.column("height").to_pylist() == [s.height for s in samples]
    assert table.column("half_offset").to_pylist()[1] == -1
    checked = version >= 3  # earlier versions have no checksums: their samples are served unchecked
    assert table.column("checksum").to_pylist() == [sample_checksum(s.data) if checked else None for s in samples]
