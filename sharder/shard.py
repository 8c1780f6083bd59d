"""``feeder shard SRC OUT``: turn an image folder tree into shards (see ``layout``)."""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm import tqdm

from sharder.config import ShardConfig, progress_shown
from sharder.images import ProcessedImage
from sharder.lmdb_copy import copy_to_lmdb
from sharder.normalise import options_of, worker_pool
from sharder.out_dir import WORK_DIR, check_out_path, prepare_out, run_identity, write_errors_named
from sharder.out_lock import OutLock
from sharder.ray_run import RayTasks, connect
from sharder.sources import SourceTree, SplitSource, find_sources
from sharder.split_writer import ShardRecord, remaining_names, write_split
from shards import jpeg
from shards.layout import (
    INDEX_VERSION,
    LMDB_DIR,
    MANIFEST_NAME,
    index_path,
)
from shards.manifest import FORMAT_VERSION, Manifest, ShardEntry, SkippedInput, SplitEntry
from shards.writers import file_sha256, write_index, write_manifest

log = logging.getLogger(__name__)

__all__ = ["ShardReport", "shard", "split_counts"]

@dataclass
class ShardReport:
    """What a run did, for the closing summary line."""

    out: Path
    splits: dict[str, dict[str, int]] = field(default_factory=dict)
    seconds: float = 0.0

    def total(self, key: str) -> int:
        return sum(counts[key] for counts in self.splits.values())

    def summary(self) -> str:
        """One line: counts per split, shards, bytes, rejects, ignored, skipped links
        and empty classes (when any), speed."""
        per_split = ", ".join(f"{name} {c['accepted']}" for name, c in self.splits.items())
        rate = self.total("inputs") / self.seconds if self.seconds > 0 else 0.0
        return (
            f"sharded {self.total('accepted')} images ({per_split}) into {self.total('shards')} shards, "
            f"{self.total('bytes') / 1e6:.1f} MB; rejected {self.total('rejected')}, "
            f"re-encoded {self.total('reencoded')}, ignored {self.total('ignored')}{self._oddities()}; "
            f"{self.seconds:.1f} s, {rate:.0f} images/s -> {self.out}"
        )

    def _oddities(self) -> str:
        links, empty = self.total("skipped_links"), self.total("empty_classes")
        text = f", skipped {links} link{'s' if links != 1 else ''}" if links else ""
        return text + (f", {empty} empty class{'es' if empty != 1 else ''}" if empty else "")


def _write_index(out: Path, split: str, records: list[ShardRecord], lmdb_only: bool) -> None:
    rows = [(r, rec) for rec in records for r in rec.rows]
    columns = {
        "key": [r[0] for r, _ in rows],
        "label": [r[1] for r, _ in rows],
        "shard": [f"{split}/{LMDB_DIR}" if lmdb_only else rec.path for _, rec in rows],
        "offset": [-1 if lmdb_only else r[2] for r, _ in rows],
        "size": [r[3] for r, _ in rows],
        "source": [r[4] for r, _ in rows],
        "width": [r[5] for r, _ in rows],
        "height": [r[6] for r, _ in rows],
        "half_offset": [-1 if lmdb_only else r[7] for r, _ in rows],
        "half_size": [0 if lmdb_only else r[8] for r, _ in rows],
        "checksum": [r[9] for r, _ in rows],
        "half_checksum": [0 if lmdb_only else r[10] for r, _ in rows],
    }
    write_index(index_path(out, split), columns)


def _split_manifest(tree: SourceTree, split: SplitSource, records: list[ShardRecord], wds: bool) -> SplitEntry:
    per_class = dict.fromkeys(tree.classes, 0)
    for rec in records:
        for row in rec.rows:
            per_class[tree.classes[row[1]]] += 1
    rejects = [SkippedInput(source=s, reason=r) for s, r in split.rejects]
    rejects += [SkippedInput(source=s, reason=r) for rec in records for s, r in rec.rejects]
    accepted = sum(per_class.values())
    shards = [
        ShardEntry(path=r.path, index=r.index, samples=r.samples, bytes=r.bytes, sha256=r.sha256)
        for r in records
        if r.path
    ]
    return SplitEntry(
        num_samples=accepted,
        accepted=accepted,
        rejected=len(rejects),
        reencoded=sum(rec.reencoded for rec in records),
        ignored=split.ignored,
        inputs=accepted + len(rejects),
        per_class=per_class,
        index=f"{split.name}/{index_path(Path(), split.name).name}",
        index_version=INDEX_VERSION,
        shards=tuple(shards) if wds else (),
        rejects=tuple(rejects),
        skipped_links=tuple(SkippedInput(source=s, reason=r) for s, r in split.skipped_links),
        empty_classes=tuple(split.empty_classes),
    )


def _finish_split(
    config: ShardConfig, tree: SourceTree, split: SplitSource, records: list[ShardRecord], tar_root: Path
) -> SplitEntry:
    wds = "wds" in config.formats
    (config.out / split.name).mkdir(parents=True, exist_ok=True)
    _write_index(config.out, split.name, records, lmdb_only=not wds)
    entry = _split_manifest(tree, split, records, wds)
    # index_sha256 lets verify tell a damaged index
    entry = replace(entry, index_sha256=file_sha256(index_path(config.out, split.name)))
    if "lmdb" in config.formats:
        entry = replace(entry, lmdb=copy_to_lmdb(config.out, tar_root, split.name, records))
    return entry


def shard(config: ShardConfig) -> ShardReport:
    """Shard ``config.src`` into ``config.out``, resuming an unfinished run there.

    Args:
        config: the run's options.

    Returns:
        A report with per-split counts; its ``summary()`` is the closing line.

    Raises:
        NotFound: SRC does not exist.
        ConfigError: no images, unusable ground truth, OUT not empty or not writable,
            another run sharding into OUT (names its pid), or a write into OUT that
            failed (names the file and the reason: no space left, a read-only file
            system; the same call resumes).
        DataError: a bad input or a directory that cannot be listed, with
            ``on_error="fail"`` (names the file or directory).
    """
    started = time.monotonic()
    if config.restart_interval != config.stored_restart_interval:
        log.warning("JPEGs are stored as they come, without restart markers: %s", jpeg.unavailable_reason())
    check_out_path(config)
    with OutLock(config.out), write_errors_named(config.out):
        tree = find_sources(config.src, config.on_error, config.store_options)
        prepare_out(config, run_identity(config, tree))
        splits = _write_splits(config, tree)
        manifest = Manifest(format_version=FORMAT_VERSION, layout=tree.layout, source=config.source_name,
                            classes=tuple(tree.classes), splits=splits, options=config.options())
        write_manifest(config.out / MANIFEST_NAME, manifest)
        shutil.rmtree(config.out / WORK_DIR)
    report = ShardReport(config.out, seconds=time.monotonic() - started)
    report.splits = {name: split_counts(entry) for name, entry in splits.items()}
    return report


def split_counts(entry: SplitEntry) -> dict[str, int]:
    """The counts of a split's manifest entry that a :class:`ShardReport` sums."""
    return {
        "inputs": entry.inputs, "accepted": entry.accepted, "rejected": entry.rejected,
        "reencoded": entry.reencoded or 0, "ignored": entry.ignored, "shards": len(entry.shards),
        "skipped_links": len(entry.skipped_links or ()), "empty_classes": len(entry.empty_classes or ()),
        "bytes": sum(s.bytes for s in entry.shards) + (entry.lmdb.bytes if entry.lmdb else 0),
    }


def _write_splits(config: ShardConfig, tree: SourceTree) -> dict[str, SplitEntry]:
    """Each split's tars (resuming those finished), index and LMDB: its manifest entry."""
    work = config.out / WORK_DIR
    # Tars are always the first stage; without "wds" they are staged under .work.
    tar_root = config.out if "wds" in config.formats else work / "tars"
    splits: dict[str, SplitEntry] = {}
    total = sum(len(s.files) for s in tree.splits)
    shown = progress_shown(config.progress)
    pool_of = (connect(config.ray, config.ray_tasks_per_node) if config.ray is not None
               else worker_pool(config.workers, [split.reader for split in tree.splits]))
    with pool_of as pool, tqdm(total=total, unit="img", desc="shard", disable=not shown) as bar:
        outcomes: list[Iterator[ProcessedImage] | None] = [None] * len(tree.splits)
        if isinstance(pool, RayTasks):  # one window of tasks over every split: none drains at a split's end
            outcomes = list(pool.outcomes(options_of(config), [
                (split.reader, remaining_names(config, split, tar_root, work / split.name)) for split in tree.splits]))
        for split, images in zip(tree.splits, outcomes):
            records = write_split(config, split, tar_root, work / split.name, bar,
                                  None if isinstance(pool, RayTasks) else pool, images)
            splits[split.name] = _finish_split(config, tree, split, records, tar_root)
    return splits
