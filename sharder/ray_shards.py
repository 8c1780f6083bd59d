"""A split written by Ray tasks on the nodes, the driver handling sizes and records only.

Two kinds of task. A *normalising* task reads a run of consecutive inputs of the
split's seeded order and normalises them; its outcomes stay in its node's object
store, and the driver gets only their sizes (and rejects). From the sizes, in order,
the driver places each shard's end exactly where a one-machine run would
(``shards.writers.tar_bytes_after``, the rule ``TarShardWriter`` itself follows), and
sends a *writing* task per shard: it takes the outcomes of the runs its range covers
(Ray moves them from the nodes that made them), writes the tar and its index to OUT
as ``split_writer`` does, records it for resume and returns its record. The driver
keeps the records in order, calls ``on_shard_done`` for each, and writes the indexes
and the manifest last. No image byte passes through the driver.

A node lost mid-run costs its tasks (retried elsewhere) and the outcomes it held
(Ray runs their normalising tasks again). A shard's record is written when its tar
is durable, perhaps before an earlier shard's: a rerun after the driver died
resumes from the consecutive records, and writes the later shards again with the
same bytes.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from tqdm import tqdm

from core.errors import DataError
from sharder.config import ShardConfig
from sharder.images import ProcessedImage
from sharder.normalise import options_of, process_files
from sharder.source_reads import Source
from sharder.sources import SourceFile, SplitSource
from sharder.split_writer import ShardRecord, _resume_point, _RollingTarWriter
from shards.writers import sample_tar_bytes, tar_bytes_after

__all__ = ["write_split_on_ray"]

# Inputs per normalising task: a task costs Ray about a millisecond to place and
# return (an image's normalising); fewer per task leave less idle at a split's end.
_PER_TASK = 32
# Task retries when a node dies under a task (Ray's own default is 3): a run on a
# cluster losing nodes one by one should still end.
_MAX_RETRIES = 8


def normalise_run(source: Source, names: list[str], options: tuple) -> tuple[list[ProcessedImage], list[tuple]]:
    """A normalising task: the outcomes of ``names`` and, for the driver, each one's
    (reject, JPEG bytes, half-scale copy bytes)."""
    outcomes = process_files(source, names, options)
    return outcomes, [(o.reject, len(o.data), len(o.half)) for o in outcomes]


def write_shard(config: ShardConfig, split: str, tar_root: Path, work_dir: Path, number: int, start: int,
                end: int, sources: list[SourceFile], skip: int, *runs: list[ProcessedImage]) -> ShardRecord | None:
    """A writing task: shard ``number`` of inputs ``start .. end`` (``sources``), their
    outcomes those of ``runs`` from the ``skip``-th on. None: nothing to record (an
    empty split)."""
    outcomes = [outcome for run in runs for outcome in run][skip:skip + end - start]
    records: list[Any] = [None] * number  # the shards before, written by other tasks
    roller = _RollingTarWriter(config, split, tar_root, work_dir, records)
    try:
        for position, (source, image) in enumerate(zip(sources, outcomes), start):
            if image.reject:
                roller.rejects.append([source.source, image.reject])
            else:
                roller.add(position, source, image)
        roller.close(consumed_end=end)
    finally:
        roller.abort()
    if len(records) > number + 1:
        raise RuntimeError(f"{split} shard {number}: its inputs {start}..{end} do not fit one tar")
    return records[number] if len(records) > number else None


@dataclass
class _Run:
    """A normalising task's run: its first position, its size, its outcomes."""

    start: int
    size: int
    outcomes: Any  # ObjectRef of list[ProcessedImage]


class _SplitOnRay:
    """The driver's side of one split."""

    def __init__(self, ray: Any, in_flight: int, config: ShardConfig, split: SplitSource, tar_root: Path,
                 work_dir: Path, bar: tqdm) -> None:
        self.ray, self.in_flight, self.config, self.split, self.bar = ray, in_flight, config, split, bar
        self.tar_root, self.work_dir = tar_root, work_dir
        self.normalise = ray.remote(num_cpus=1, num_returns=2, max_retries=_MAX_RETRIES)(normalise_run)
        self.write = ray.remote(num_cpus=1, max_retries=_MAX_RETRIES)(write_shard)
        self.task_config = replace(config, on_shard_done=None)  # called here, in order
        self.order, self.records, self.start = _resume_point(config, split, tar_root, work_dir)
        self.held: deque[_Run] = deque()  # runs a shard still to be sent may need
        self.writing: deque[tuple[int, int, Any]] = deque()  # (number, inputs, ObjectRef of its record)
        self.next_number = len(self.records)

    def run(self) -> list[ShardRecord]:
        self.bar.update(self.start)
        sizes: deque[tuple[_Run, Any]] = deque()
        runs = iter(range(self.start, len(self.order), _PER_TASK))
        shard_start, tar_bytes = self.start, None  # None: no sample in the open shard yet
        while True:
            while len(sizes) < self.in_flight and (at := next(runs, None)) is not None:
                sizes.append(self._normalise(at))
            if not sizes:
                break
            run, sized = sizes.popleft()
            self.held.append(run)
            for position, (reject, data_bytes, half_bytes) in enumerate(self.ray.get(sized), run.start):
                if reject:
                    if self.config.on_error == "fail":
                        raise DataError(f"{self.split.reader.shown(self.order[position].source)}: {reject}")
                    continue
                if tar_bytes is not None and tar_bytes_after(tar_bytes, data_bytes, half_bytes) > \
                        self.config.shard_size_bytes:
                    self._send_shard(shard_start, position)
                    shard_start, tar_bytes = position, None
                label_digits = len(str(self.order[position].label))
                tar_bytes = (tar_bytes or 0) + sample_tar_bytes(data_bytes, label_digits, half_bytes)
        if self.start < len(self.order) or not self.records:
            self._send_shard(shard_start, len(self.order))
        while self.writing:
            self._take_record()
        return self.records

    def _normalise(self, at: int) -> tuple[_Run, Any]:
        names = [f.source for f in self.order[at:at + _PER_TASK]]
        outcomes, sized = self.normalise.remote(self.split.reader.for_names(names), names, options_of(self.config))
        return _Run(at, len(names), outcomes), sized

    def _send_shard(self, start: int, end: int) -> None:
        covering = [run for run in self.held if run.start < end and run.start + run.size > start]
        skip = start - covering[0].start if covering else 0
        record = self.write.remote(self.task_config, self.split.name, self.tar_root, self.work_dir, self.next_number,
                                   start, end, self.order[start:end], skip, *(run.outcomes for run in covering))
        self.writing.append((self.next_number, end - start, record))
        self.next_number += 1
        while self.held and self.held[0].start + self.held[0].size <= end:
            self.held.popleft()
        while len(self.writing) > self.in_flight:
            self._take_record()

    def _take_record(self) -> None:
        number, inputs, pending = self.writing.popleft()
        record = self.ray.get(pending)
        self.bar.update(inputs)
        if record is None:
            return
        self.records.append(record)
        self.bar.set_postfix_str(f"{self.split.name} shards {len(self.records)}", refresh=False)
        if self.config.on_shard_done is not None:
            self.config.on_shard_done(self.split.name, number)


def write_split_on_ray(ray: Any, in_flight: int, config: ShardConfig, split: SplitSource, tar_root: Path,
                       work_dir: Path, bar: tqdm) -> list[ShardRecord]:
    """``split_writer.write_split`` with Ray tasks normalising and writing.

    Args:
        ray: the ``ray`` module, connected.
        in_flight: tasks of each kind in flight.

    Returns:
        The records of all shards of the split, in order.

    Raises:
        DataError: a bad input with ``on_error="fail"``.
    """
    (tar_root / split.name).mkdir(parents=True, exist_ok=True)
    work_dir.mkdir(parents=True, exist_ok=True)
    return _SplitOnRay(ray, in_flight, config, split, tar_root, work_dir, bar).run()
