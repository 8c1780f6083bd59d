"""What a stream's producer thread does: plan slices in, ready batches out (read ->
decode + augment into the transport's slot), with the error policy applied to the
samples that cannot be served.

The runner hands back one outcome per job, in order (:mod:`decode.jobs`); a
:class:`~decode.jobs.Failed` one names its failing samples. Here, and only here, the
policy decides: a half-scale copy that failed is read from its image instead; under
``skip`` the failing samples are replaced by repeats (:class:`SampleFilter`), under
``fail`` the stream ends naming the first. The repaired job runs alone and comes out
in its place, before the batches behind it.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Generator, Iterable, Iterator
from dataclasses import dataclass, replace
from typing import Protocol

import numpy as np

from core.bad_input import OnError
from core.errors import DataError, SampleCorrupt, SamplesUnreadable
from core.workers import Lane
from decode.augment import Jitter, sample_crops
from decode.jobs import Allocate, Decoded, Failed, Job, JobT, Outcome
from decode.pipeline import PipelineSpec
from feeder.bad_samples import SampleFilter, Screened, UnservableSample
from feeder.metrics import ServerMetrics
from feeder.mixed_split import SplitView
from protocol.batch import BatchMeta
from protocol.plan import BatchSlice
from protocol.request import AugmentKind, CropRange
from transport.base import Slot

__all__ = ["BatchRunner", "PlannedJob", "Producer", "ReadyBatch", "StreamContext"]

_log = logging.getLogger(__name__)
_NO_BYTES = np.empty(0, dtype=np.uint8)  # a sample whose pixels the runner holds: no bytes read


@dataclass(frozen=True)
class ReadyBatch:
    """A decoded, augmented batch: its small fields and the transport slot its pixels
    are in (host memory, or the client's GPU)."""

    meta: BatchMeta
    slot: Slot

    @property
    def images(self) -> np.ndarray:
        """The pixels (a CUDA tensor for a device slot)."""
        return self.slot.pixels  # type: ignore[return-value]


@dataclass(frozen=True, kw_only=True)
class PlannedJob(Job):
    """A job of the plan: the batch it decodes (known bad samples already replaced),
    and which samples' bytes are their half-scale copies (bool per sample; None:
    none are)."""

    screened: Screened
    from_copies: np.ndarray | None = None


class BatchRunner(Protocol):
    """What turns a stream's jobs into batches: a :class:`decode.runner.PipelineRunner`,
    or one in front of the decoded cache (:class:`decode.cached_runner.CachedRunner`)."""

    spec: PipelineSpec
    lane: Lane  # where its CPU work runs: the stream's share of the daemon's workers
    # Jobs may bring a sample's half-scale copy with its window in the copy's pixels
    # (a pipeline decoding windows); False: the images themselves (the decoded cache
    # keeps whole images, and maps windows in the image's own pixels).
    decodes_half_copies: bool
    prefetch: int  # runs kept in flight (may change between runs)

    @property
    def device_copies(self) -> int: ...  # GPU outputs copied device to device

    @property
    def host_copies(self) -> int: ...  # GPU outputs copied through host memory

    @property
    def decoded_early(self) -> int: ...  # slow samples whose decoding started ahead of their batch

    # Which samples of a batch it needs no bytes of (True: it holds their pixels, and
    # keeps them until they are run); None: it needs every sample's.
    def held(self, indices: np.ndarray, image_size: int) -> np.ndarray | None: ...

    def run_many(self, jobs: Iterable[JobT], allocate: Allocate) -> Generator[Outcome[JobT], None, None]: ...

    def run_alone(self, job: JobT, allocate: Allocate) -> Outcome[JobT]: ...


@dataclass(frozen=True)
class StreamContext:
    """What a producer needs besides the plan: where bytes come from (``split``: one
    split, or a mix's composite split),
    what runs (``runner``), the output's sizes, what draws each sample's crop window,
    flip and photometric factors (``kind``, ``seed``, ``crop``, ``jitter``, with the
    batch's epoch and the samples' keys), the error policy (``samples``) and the
    ready queue's bounds."""

    split: SplitView
    runner: BatchRunner
    image_size: int
    samples_per_rank: int
    samples: SampleFilter
    queue_batches: int
    queue_bytes: int
    kind: AugmentKind = AugmentKind.TRAIN
    seed: int = 0
    crop: CropRange = CropRange()
    jitter: Jitter = Jitter()


class Producer:
    """Ready batches of a stream's plan slices, in order.

    Args:
        context: split, runner, sizes and policy.
        metrics: daemon counters (stage times, bad samples, GPU copies).
    """

    def __init__(self, context: StreamContext, metrics: ServerMetrics) -> None:
        self._ctx = context
        self._metrics = metrics
        self._read_s = 0.0  # total seconds spent reading, to separate it from decoding
        # Whether most of the last batch was not in the page cache. Read-ahead hints
        # (one posix_fadvise per sample) help only then; otherwise they cost 1.5 us a
        # sample for nothing. Most, not any: the cache turns a read away now and then
        # even for a file it holds (seen on freshly written shards), while reads from
        # a disk miss on nearly every sample.
        self._reads_from_disk = True
        # The runner's (device_copies, host_copies) when last reported: it is pooled, so counts start anywhere.
        self._copies = (context.runner.device_copies, context.runner.host_copies)
        self._early = context.runner.decoded_early  # likewise

    def batches(self, slices: Iterator[BatchSlice], allocate: Allocate) -> Generator[ReadyBatch, None, None]:
        """One ready batch per slice; pixels written into ``allocate``'s slots.

        Raises:
            UnservableSample: under ``fail``, a sample that cannot be served.
            DataError: a shard that cannot be read (names it), or a run that failed
                with no sample to blame.
        """
        # Closed here, on the thread that drives it, never left to the garbage
        # collector: that may run it on any thread, a pool worker included, where
        # waiting for the runner's work could never end.
        with contextlib.closing(self._ctx.runner.run_many(self._jobs(slices), allocate)) as outcomes:
            while True:
                started, read_before = time.perf_counter(), self._read_s
                outcome = next(outcomes, None)
                if outcome is None:
                    return
                # Time blocked on decoding, less the reads of next batches done meanwhile.
                self._metrics.stage("decode_augment", time.perf_counter() - started - (self._read_s - read_before))
                decoded = self._resolved(outcome, allocate)
                self._count_copies()
                yield self._ready(decoded)

    def _jobs(self, slices: Iterator[BatchSlice]) -> Iterator[PlannedJob]:
        split = self._ctx.split
        upcoming = next(slices, None)
        while upcoming is not None:
            batch, upcoming = upcoming, next(slices, None)
            started = time.perf_counter()
            if upcoming is not None and self._reads_from_disk:
                split.will_need(upcoming.indices)  # one batch of read-ahead
            job = self._job(self._ctx.samples.screen(batch))  # known bad samples are not even read
            seconds = time.perf_counter() - started
            self._read_s += seconds
            self._metrics.stage("read", seconds)
            yield job

    def _job(self, screened: Screened) -> PlannedJob:
        """The bytes and crop windows of a batch's samples (a half-scale copy and the
        window in its pixels, where the sample has one and its window is at least
        twice the output). A sample whose bytes differ from their checksum, or that a
        store refuses for good, is bad data under the policy: its image is read
        instead of such a copy, and under ``skip`` such an image is replaced like one
        that does not decode.

        Raises:
            SampleCorrupt: under ``fail``, a sample's bytes were changed after sharding.
            SamplesUnreadable: under ``fail``, a store refused a sample (names the URL
                and the key).
            DataError: a tar that cannot be read (names it).
        """
        for _ in range(2 * len(screened.batch.indices) + 1):  # each round drops a copy or replaces a sample
            try:
                return self._read(screened)
            except SampleCorrupt as e:
                screened = self._around_corrupt(screened, e)
            except SamplesUnreadable as e:
                screened = self._around_unreadable(screened, e)
        raise DataError(f"{self._ctx.split.split}: a batch whose samples keep changing while read")

    def _around_corrupt(self, screened: Screened, error: SampleCorrupt) -> Screened:
        """``screened`` with the sample of ``error`` read from its image (a changed
        copy) or replaced (``skip``)."""
        if error.half:
            self._ctx.split.drop_copies([error.index])
            return screened
        if self._ctx.samples.on_error is OnError.FAIL:
            raise error
        positions = np.flatnonzero(screened.batch.indices == error.index)
        reason = f"its bytes in {error.path.name} differ from their checksum in the index"
        return self._ctx.samples.replace(screened, {int(positions[0]): reason})

    def _around_unreadable(self, screened: Screened, error: SamplesUnreadable) -> Screened:
        """``screened`` with the refused copies read from their images and (``skip``)
        the refused images replaced."""
        self._ctx.split.drop_copies([s.index for s in error.samples if s.half])
        images = [s for s in error.samples if not s.half]
        if not images:
            return screened
        if self._ctx.samples.on_error is OnError.FAIL:
            raise error
        indices = screened.batch.indices
        reasons = {int(np.flatnonzero(indices == s.index)[0]): f"cannot be read from {s.url} ({s.reason})"
                   for s in images}
        return self._ctx.samples.replace(screened, reasons)

    def _read(self, screened: Screened) -> PlannedJob:
        split, ctx, batch = self._ctx.split, self._ctx, screened.batch
        crops = sample_crops(
            ctx.kind, ctx.seed, batch.epoch, [split.keys[int(i)] for i in batch.indices],
            split.widths[batch.indices], split.heights[batch.indices], ctx.crop, ctx.jitter,
        )
        uncached = split.uncached_reads
        from_copies = None
        if ctx.runner.decodes_half_copies:
            jpegs, boxes, from_copies = split.read_windows(batch.indices, crops.boxes, ctx.image_size)
            crops = replace(crops, boxes=boxes)  # the windows in their copies' pixels; the rest as drawn
        else:
            jpegs = self._unheld(batch.indices)
        # (another stream's misses count too: it is only a hint)
        self._reads_from_disk = 2 * (split.uncached_reads - uncached) > len(jpegs)
        return PlannedJob(jpegs, ctx.image_size, crops, batch.indices, screened=screened, from_copies=from_copies)

    def _unheld(self, indices: np.ndarray) -> list[np.ndarray]:
        """The bytes of the samples at ``indices`` the runner does not hold (those it
        holds get none: their pixels are served from where it keeps them, read and
        checked once already)."""
        split = self._ctx.split
        held = self._ctx.runner.held(indices, self._ctx.image_size)
        if held is None or not held.any():
            return split.read_many(indices)
        jpegs = [_NO_BYTES] * len(indices)
        wanted = np.flatnonzero(~held)
        for position, jpeg in zip(wanted, split.read_many(indices[wanted]) if len(wanted) else []):
            jpegs[position] = jpeg
        return jpegs

    def _resolved(self, outcome: Outcome[PlannedJob], allocate: Allocate) -> Decoded[PlannedJob]:
        """``outcome`` with the policy applied until it decodes: each round replaces
        at least one sample (or reads one from its image instead of its copy)."""
        for _ in range(2 * len(outcome.job) + 1):
            if isinstance(outcome, Decoded):
                return outcome
            outcome = self._ctx.runner.run_alone(self._repaired(outcome), allocate)
        if isinstance(outcome, Decoded):
            return outcome
        raise DataError(f"a batch still failed after every sample was replaced: {outcome.error}")

    def _repaired(self, failed: Failed[PlannedJob]) -> PlannedJob:
        """The job to run instead of ``failed.job``: samples whose half-scale copies
        failed read from their images (whether those decode is tried before any
        sample is blamed), else the failing samples replaced (``skip``).

        Raises:
            UnservableSample: under ``fail``, naming the first failing sample.
        """
        self._metrics.decode_retried()
        job, failures = failed.job, failed.error.failures or {}
        if self._drop_failed_copies(job, sorted(failures)):
            return self._job(job.screened)
        reasons = {pos: f"does not decode ({reason})" for pos, reason in failures.items()}
        samples = self._ctx.samples
        if samples.on_error is OnError.FAIL:
            pos = min(reasons)
            key = self._ctx.split.keys[int(job.screened.batch.indices[pos])]
            raise UnservableSample(f"{self._ctx.split.split}/{key}: {reasons[pos]}")
        return self._job(samples.replace(job.screened, reasons))

    def _drop_failed_copies(self, job: PlannedJob, positions: list[int]) -> bool:
        """Of the samples at ``positions``, those decoded from their half-scale copies
        are read from their images from now on (with a warning naming each). False
        when none was."""
        if job.from_copies is None:
            return False
        split, rows = self._ctx.split, job.screened.batch.indices
        failed = [int(rows[p]) for p in positions if job.from_copies[p]]
        if not failed:
            return False
        split.drop_copies(failed)
        for i in failed:
            _log.warning("%s: the half-scale copy of sample %s does not decode; its image is read instead",
                         split.tar(i), split.keys[i])
        return True

    def _count_copies(self) -> None:
        """Reports the GPU outputs the runner has copied since the last call, by
        where they went (device to device, or through host memory), and the slow
        samples it started decoding early."""
        runner = self._ctx.runner
        if runner.decoded_early != self._early:
            self._metrics.decoded_early(runner.decoded_early - self._early)
            self._early = runner.decoded_early
        device, host = runner.device_copies - self._copies[0], runner.host_copies - self._copies[1]
        if device or host:
            self._metrics.gpu_batches(device + host, host)
        self._copies = (runner.device_copies, runner.host_copies)

    def _ready(self, decoded: Decoded[PlannedJob]) -> ReadyBatch:
        split, screened = self._ctx.split, decoded.job.screened
        batch, samples = screened.batch, self._ctx.samples
        samples.delivered(screened)
        for dataset, count in samples.failed_by_dataset(screened.failed).items():  # each under its own dataset
            self._metrics.samples_failed(dataset, split.split, count)
        meta = BatchMeta(
            epoch=batch.epoch,
            cursor=batch.cursor,
            samples_per_rank=batch.part_length or self._ctx.samples_per_rank,
            keys=[split.keys[int(i)] for i in batch.indices],
            labels=split.labels[batch.indices],
            padding=batch.padding,
            failed_keys=[split.keys[i] for i in screened.failed],
        )
        return ReadyBatch(meta, decoded.slot)
