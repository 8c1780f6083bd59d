"""Write one split: shuffle its inputs, normalise them (in worker processes), roll
them into tars, and remember each finished shard so a killed run can resume.

Resume protocol: after a tar and its ``.idx`` are durable under their final names,
``.work/<split>/shard-NNNNNN.json`` records the shard (its index rows, its rejects,
and ``consumed_end``, the position in the shuffled input order up to which inputs are
accounted for). A restarted run loads these records, skips the inputs they cover and
writes the next shard. Shard boundaries depend only on the inputs and options, so
the result is byte-identical to an uninterrupted run.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.pool import Pool
from pathlib import Path
from typing import BinaryIO

import numpy as np
from tqdm import tqdm

from core.errors import DataError
from sharder.config import ShardConfig
from sharder.images import ProcessedImage
from sharder.normalise import processed_in_order
from sharder.sources import SourceFile, SplitSource
from shards.layout import sample_checksum, shard_name
from shards.writers import Sample, TarShardWriter, write_json_atomic

__all__ = ["ShardRecord", "load_records", "remaining_names", "sample_key", "shuffled", "write_split"]

_KEY_STEM_CHARS = 48  # keep tar member names far below the 100-byte ustar limit
_CHECKSUM_ROW = 9  # where a record's row has its checksums (see ShardRecord.rows)


@dataclass
class ShardRecord:
    """One finished shard and the inputs it accounts for."""

    number: int
    consumed_end: int
    path: str
    index: str
    samples: int
    bytes: int
    sha256: str
    reencoded: int = 0
    # key, label, offset, size, source, width, height, half_offset, half_size, checksum, half_checksum
    rows: list[list] = field(default_factory=list)
    rejects: list[list[str]] = field(default_factory=list)  # source, reason


def shuffled(files: list[SourceFile], seed: int) -> list[SourceFile]:
    """``files`` in the seeded global order they are written in."""
    order = np.random.default_rng(seed).permutation(len(files))
    return [files[i] for i in order.tolist()]


def sample_key(position: int, source: str) -> str:
    """``00001234_n01440764_10026``: position first (sorts in write order), no dots."""
    stem = re.sub(r"[^A-Za-z0-9_-]", "_", Path(source).name.split(".")[0])[:_KEY_STEM_CHARS]
    return f"{position:08d}_{stem}"


def load_records(work_dir: Path, tar_root: Path) -> list[ShardRecord]:
    """The consecutive finished shards recorded in ``work_dir`` (their tars under
    ``tar_root``)."""
    records: list[ShardRecord] = []
    while (path := work_dir / shard_name(len(records), ".json")).is_file():
        records.append(_with_checksums(ShardRecord(**json.loads(path.read_text(encoding="utf-8"))), tar_root))
    return records


def _checksum_at(tar: BinaryIO, offset: int, size: int) -> int:
    """The checksum of the ``size`` bytes at ``offset`` (0 for none: no half-scale copy)."""
    if size <= 0:
        return 0
    tar.seek(offset)
    return sample_checksum(tar.read(size))


def _with_checksums(record: ShardRecord, tar_root: Path) -> ShardRecord:
    """``record`` with the checksums of its samples, read from its tar where it was
    recorded without them (by a run of an earlier version, now resumed)."""
    if all(len(row) > _CHECKSUM_ROW for row in record.rows):
        return record
    with open(tar_root / record.path, "rb") as tar:
        for row in record.rows:
            del row[_CHECKSUM_ROW:]
            row += [_checksum_at(tar, offset, size) for offset, size in ((row[2], row[3]), (row[7], row[8]))]
    return record


class _RollingTarWriter:
    """Rolls samples into consecutive tars of at most ``shard_size_bytes``."""

    def __init__(self, config: ShardConfig, split: str, tar_root: Path, work_dir: Path, records: list[ShardRecord]):
        self.config, self.split, self.tar_root, self.work_dir = config, split, tar_root, work_dir
        self.records = records
        self.writer: TarShardWriter | None = None
        self.rows: list[list] = []
        self.rejects: list[list[str]] = []
        self.reencoded = 0

    def add(self, position: int, source: SourceFile, image: ProcessedImage) -> None:
        if (
            self.writer is not None
            and self.writer.bytes_after(len(image.data), len(image.half)) > self.config.shard_size_bytes
        ):
            self.close(consumed_end=position)
        if self.writer is None:
            self.writer = TarShardWriter(self.tar_root / self.split / shard_name(len(self.records)))
        self.reencoded += image.reencoded
        key = sample_key(position, source.source)
        stored = self.writer.write(Sample(key, source.label, image.data, image.width, image.height, image.half))
        self.rows.append([key, source.label, stored.offset, stored.size, source.source, image.width, image.height,
                          stored.half_offset, stored.half_size, stored.checksum, stored.half_checksum])

    def close(self, consumed_end: int) -> None:
        """Finish the open tar (if any) and record it with the rejects seen so far."""
        writer, number = self.writer, len(self.records)
        if writer is not None:
            writer.finish()
        elif not self.rejects:
            return
        record = ShardRecord(
            number=number,
            consumed_end=consumed_end,
            path=f"{self.split}/{shard_name(number)}" if writer else "",
            index=f"{self.split}/{shard_name(number, '.idx')}" if writer else "",
            samples=writer.samples if writer else 0,
            bytes=writer.bytes_written if writer else 0,
            sha256=writer.sha256 if writer else "",
            reencoded=self.reencoded,
            rows=self.rows,
            rejects=self.rejects,
        )
        write_json_atomic(self.work_dir / shard_name(number, ".json"), vars(record), indent=None)
        self.records.append(record)
        self.writer, self.rows, self.rejects, self.reencoded = None, [], [], 0
        if self.config.on_shard_done is not None:
            self.config.on_shard_done(self.split, number)

    def abort(self) -> None:
        if self.writer is not None:
            self.writer.abort()


def _resume_point(config: ShardConfig, split: SplitSource, tar_root: Path,
                  work_dir: Path) -> tuple[list[SourceFile], list[ShardRecord], int]:
    """The split's write order, its finished shards, and where the next shard starts."""
    order = shuffled(split.files, config.seed)
    records = load_records(work_dir, tar_root)
    return order, records, records[-1].consumed_end if records else 0


def remaining_names(config: ShardConfig, split: SplitSource, tar_root: Path, work_dir: Path) -> list[str]:
    """The source names ``write_split`` has still to take from ``split``, in order."""
    order, _, start = _resume_point(config, split, tar_root, work_dir)
    return [f.source for f in order[start:]]


def write_split(
    config: ShardConfig, split: SplitSource, tar_root: Path, work_dir: Path, bar: tqdm, pool: Pool | None,
    outcomes: Iterator[ProcessedImage] | None = None,
) -> list[ShardRecord]:
    """Write (or finish writing) the tars of ``split`` under ``tar_root/<split>/``.

    Args:
        config: the run's options.
        split: the split's inputs (sorted), as found under SRC.
        tar_root: OUT, or a staging folder when tars are not a requested format.
        work_dir: where finished shards are recorded for resume.
        bar: progress bar to advance by one per input; it shows the shards done.
        pool: worker processes from ``worker_pool`` (None: work in this process).
        outcomes: the outcome of each input of ``remaining_names``, in order, made
            elsewhere (Ray tasks); None: made here, with ``pool``.

    Returns:
        The records of all shards of the split, in order.

    Raises:
        DataError: a bad input with ``on_error="fail"``.
    """
    (tar_root / split.name).mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    order, records, start = _resume_point(config, split, tar_root, work_dir)
    bar.update(start)
    roller = _RollingTarWriter(config, split.name, tar_root, work_dir, records)
    remaining = order[start:]
    shown_shards = -1
    images = (outcomes if outcomes is not None
              else processed_in_order(config, split.reader, [f.source for f in remaining], pool))
    try:
        for position, (source, image) in enumerate(zip(remaining, images), start):
            if len(records) != shown_shards:
                shown_shards = len(records)
                bar.set_postfix_str(f"{split.name} shards {shown_shards}", refresh=False)
            if image.reject:
                if config.on_error == "fail":
                    raise DataError(f"{split.reader.shown(source.source)}: {image.reject}")
                roller.rejects.append([source.source, image.reject])
            else:
                roller.add(position, source, image)
            bar.update(1)
        if start < len(order) or not records:
            roller.close(consumed_end=len(order))
        bar.set_postfix_str(f"{split.name} shards {len(records)}")
    finally:
        roller.abort()
    return records
