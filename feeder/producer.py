"""One open stream: a producer thread turns plan slices into ready batches (read ->
decode+augment) and puts them on a bounded queue; the consumer drains it.

The queue bound is the backpressure: a slow client fills its own queue, then its own
producer waits, and nothing grows. ``close()`` (client gone, shutdown, end) stops the
producer, empties the queue and returns the pipeline to its pool.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from core.errors import DataError, FeederError
from feeder.augment import AugmentKind, CropRange, Crops, sample_crops
from feeder.bad_samples import BadSamples, OnError, SampleFilter, Screened, UnservableSample, decode_reason
from feeder.diagnose import name_bad_sample
from feeder.metrics import ServerMetrics
from feeder.pipeline import Allocate, Job, Output, PipelineSpec, Repair, SampleDecodeError
from feeder.plan import BatchSlice
from feeder.ready_queue import ReadyQueue
from shards.reader import SplitIndex
from transport.base import BatchMeta, BatchSender, Slot, TransportClosed

__all__ = ["BatchStream", "ReadyBatch"]

_log = logging.getLogger(__name__)
_POLL_S = 0.1  # how often blocked queue operations look at the stop flag
_END = object()


@dataclass(frozen=True)
class ReadyBatch:
    """A decoded, augmented batch and where it leaves the stream."""

    epoch: int
    cursor: int
    samples_per_rank: int
    keys: list[str]
    labels: np.ndarray
    images: Output  # host memory, or the client's GPU (a CUDA IPC slot)
    padding: np.ndarray
    slot: Slot | None = None  # the transport's memory ``images`` lives in
    failed_keys: list[str] = field(default_factory=list)  # replaced samples (marked in padding)


class BatchRunner(Protocol):
    """What turns a stream's jobs into image batches: a DALI
    :class:`feeder.pipeline.PipelineRunner`, or one in front of the decoded cache
    (:class:`feeder.cached_runner.CachedRunner`)."""

    spec: PipelineSpec
    # Jobs may bring a sample's half-scale copy with its window in the copy's pixels
    # (a pipeline decoding windows); False: the images themselves (the decoded cache
    # keeps whole images, and maps windows in the image's own pixels).
    decodes_half_copies: bool

    @property
    def device_copies(self) -> int: ...  # GPU outputs copied device to device

    @property
    def host_copies(self) -> int: ...  # GPU outputs copied through host memory

    def run_many(
        self, batches: Iterable[Job], repair: Repair | None = None, allocate: Allocate | None = None
    ) -> Iterator[Output]: ...

    def drain(self) -> None: ...


@dataclass(frozen=True)
class StreamContext:
    """What a producer needs besides the plan: where bytes come from, what to run,
    where the pixels go (``sender``: the stream's transport, whose slots the pipeline
    writes into) and what draws each sample's crop window and flip (``kind``,
    ``seed``, ``crop``, with the batch's epoch and the samples' keys). ``samples``
    applies the error policy to samples that cannot be served (None: none known, the
    stream fails on the first)."""

    split: SplitIndex
    runner: BatchRunner
    sender: BatchSender
    image_size: int
    samples_per_rank: int
    queue_batches: int
    queue_bytes: int
    kind: AugmentKind = AugmentKind.TRAIN
    seed: int = 0
    crop: CropRange = CropRange()
    samples: SampleFilter | None = None


class BatchStream:
    """Producer thread + bounded queue for one stream. Iterate to receive batches;
    iteration raises the :class:`FeederError` that ended the stream, if any.

    Args:
        context: split, runner and sizes.
        slices: the plan's batches for this stream.
        metrics: daemon counters.
        on_close: called once with (stream, runner, healthy) when it closes.
    """

    def __init__(
        self,
        context: StreamContext,
        slices: Iterator[BatchSlice],
        metrics: ServerMetrics,
        on_close: Callable[[BatchStream, BatchRunner, bool], None],
    ) -> None:
        self._ctx = context
        self._filter = context.samples or SampleFilter(BadSamples("", context.split, 1 << 62), OnError.FAIL)
        self._slices = slices
        self._metrics = metrics
        self._on_close = on_close
        self._queue = ReadyQueue(context.queue_batches, context.queue_bytes, metrics.queued_bytes)
        self._stop = threading.Event()
        self._healthy = True
        self._read_s = 0.0  # total seconds spent reading, to separate it from decoding
        # Whether most of the last batch was not in the page cache. Read-ahead hints
        # (one posix_fadvise per sample) help only then; otherwise they cost 1.5 us a
        # sample for nothing. Most, not any: the cache turns a read away now and then
        # even for a file it holds (seen on freshly written shards), while reads from
        # a disk miss on nearly every sample.
        self._reads_from_disk = True
        self._read_error: DataError | None = None  # a shard that could not be read: already names the sample
        # The runner's (device_copies, host_copies) when last reported: it is pooled, so counts start anywhere.
        self._copies = (context.runner.device_copies, context.runner.host_copies)
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._produce, name="feeder-producer", daemon=True)
        self.opened_s = time.monotonic()
        # When the consumer last took a batch; None while it waits for the next one.
        self._taken_s: float | None = self.opened_s
        self.samples_sent = self.batches_sent = 0
        self.outcome = "cancelled"  # until the stream ends by itself or by an error

    def start(self) -> BatchStream:
        """Start the producer, unless the stream was closed first (daemon shutdown
        between registering the stream and starting it)."""
        with self._close_lock:
            if not self._closed:
                self._thread.start()
        return self

    def idle_s(self) -> float:
        """Seconds since the consumer took its last batch without coming back for
        another (0 while it waits for one: then the producer is the slow side)."""
        taken = self._taken_s
        return 0.0 if taken is None else time.monotonic() - taken

    def __iter__(self) -> Iterator[ReadyBatch]:
        while True:
            self._taken_s = None
            item = self._get()
            self._taken_s = time.monotonic()
            if item is _END:
                if not self._stop.is_set():
                    self.outcome = "finished"
                return
            if isinstance(item, FeederError):
                self.outcome = f"failed: {type(item).__name__}: {item}"
                raise item
            if not isinstance(item, ReadyBatch):
                raise TypeError(f"unexpected queue item {item!r}")
            waited = time.perf_counter()
            yield item
            self._metrics.stage("send", time.perf_counter() - waited)
            self._metrics.batch_sent(len(item.keys), item.images.nbytes)
            self.samples_sent += len(item.keys)
            self.batches_sent += 1

    def close(self) -> None:
        """Stop the producer, drop queued batches, give the pipeline back. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            started = self._thread.ident is not None
        self._stop.set()
        self._ctx.sender.close()  # a producer waiting for a free slot stops waiting
        self._drain_queue()
        if started:
            self._thread.join()
        self._drain_queue()
        self._on_close(self, self._ctx.runner, self._healthy)

    def _get(self) -> object:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if isinstance(item, ReadyBatch):
                self._metrics.queued.dec()
            return item
        return _END

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_S)
            except queue.Full:
                continue
            if isinstance(item, ReadyBatch):
                self._metrics.queued.inc()
            return True
        return False

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            if isinstance(item, ReadyBatch):
                self._metrics.queued.dec()

    def _produce(self) -> None:
        pending: deque[Screened] = deque()

        def repair(job: Job, error: SampleDecodeError) -> Job:
            # The runner repairs the oldest run it has not returned: pending[0]'s.
            self._metrics.decode_retried()
            # Samples that failed from their half-scale copies run again from their
            # images first; only then are failing samples replaced.
            if not self._drop_failed_copies(job, error.positions or ()):
                pending[0] = self._filter.replace(pending[0], error.positions or (), decode_reason(str(error)))
            return self._job(pending[0])

        try:
            skip = self._filter.on_error is OnError.SKIP
            slots: dict[int, tuple[Slot, Output]] = {}  # by id() of the array written into
            outputs = self._ctx.runner.run_many(self._read_batches(pending), repair if skip else None,
                                                self._slot_array(slots))
            while True:
                started, read_before = time.perf_counter(), self._read_s
                images = next(outputs, None)
                if images is None:
                    break
                # Time blocked on DALI, less the reads of next batches done meanwhile.
                waited = time.perf_counter() - started - (self._read_s - read_before)
                self._metrics.stage("decode_augment", waited)
                self._count_copies()
                if not self._put(self._ready(pending.popleft(), images, slots.pop(id(images))[0])):
                    return
            self._put(_END)
        except TransportClosed:
            return  # closed while waiting for a slot: nobody reads any more
        except UnservableSample as e:  # names the sample already; the runner is fine
            self._put(e)
        except DataError as e:
            self._healthy = False
            if e is self._read_error:
                self._put(e)
            else:
                self._put(name_bad_sample(self._ctx.split, [int(i) for s in pending for i in s.batch.indices], e))
        except FeederError as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 - a producer must report, never die silently
            self._healthy = False
            error = FeederError(f"stream failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._put(error)

    def _read_batches(self, pending: deque[Screened]) -> Iterator[Job]:
        split = self._ctx.split
        upcoming = next(self._slices, None)
        while upcoming is not None and not self._stop.is_set():
            batch, upcoming = upcoming, next(self._slices, None)
            started = time.perf_counter()
            if upcoming is not None and self._reads_from_disk:
                split.will_need(upcoming.indices)  # one batch of read-ahead
            screened = self._filter.screen(batch)  # known bad samples are not even read
            job = self._job(screened)
            seconds = time.perf_counter() - started
            self._read_s += seconds
            self._metrics.stage("read", seconds)
            pending.append(screened)
            yield job

    def _job(self, screened: Screened) -> Job:
        """The bytes and crop windows of a batch's samples (a half-scale copy and the
        window in its pixels, where the sample has one and its window is at least
        twice the output)."""
        split, ctx, batch = self._ctx.split, self._ctx, screened.batch
        crops = sample_crops(
            ctx.kind, ctx.seed, batch.epoch, [split.keys[int(i)] for i in batch.indices],
            split.widths[batch.indices], split.heights[batch.indices], ctx.crop,
        )
        uncached = split.uncached_reads
        try:
            from_copies = None
            if ctx.runner.decodes_half_copies:
                jpegs, boxes, from_copies = split.read_windows(batch.indices, crops.boxes, ctx.image_size)
                crops = Crops(boxes=boxes, flips=crops.flips)
            else:
                jpegs = split.read_many(batch.indices)
        except DataError as e:
            self._read_error = e  # names the shard already
            raise
        # (another stream's misses count too: it is only a hint)
        self._reads_from_disk = 2 * (split.uncached_reads - uncached) > len(jpegs)
        return Job(jpegs, ctx.image_size, crops, indices=batch.indices, from_copies=from_copies)

    def _drop_failed_copies(self, job: Job, positions: Sequence[int]) -> bool:
        """Of the samples at ``positions``, those decoded from their half-scale copies
        are read from their images from now on (with a warning naming each): whether
        the images decode is then tried before any sample is blamed. False when none
        was."""
        if job.from_copies is None or job.indices is None:
            return False
        failed = [int(job.indices[p]) for p in positions if job.from_copies[p]]
        if not failed:
            return False
        split = self._ctx.split
        split.drop_copies(failed)
        for i in failed:
            _log.warning("%s: the half-scale copy of sample %s does not decode; its image is read instead",
                         split.root / split.shard_of(i), split.keys[i])
        return True

    def _slot_array(self, slots: dict[int, tuple[Slot, Output]]) -> Callable[[tuple[int, ...]], Output]:
        """Where each batch is written: a slot of the stream's transport (waits
        while the transport's ring is full: the client's backpressure), as a numpy
        array in host memory or as the CUDA tensor of a device slot. The slot is
        found again by the array the pipeline returns (a repaired batch can come out
        after batches allocated later)."""

        def allocate(shape: tuple[int, ...]) -> Output:
            slot = self._ctx.sender.slot_for(shape)
            array = slot.array if slot.tensor.device.type == "cpu" else slot.tensor
            slots[id(array)] = (slot, array)  # the array kept alive: its id stays taken
            return array

        return allocate

    def _count_copies(self) -> None:
        """Reports the GPU outputs the runner has copied since the last call, by
        where they went (device to device, or through host memory)."""
        runner = self._ctx.runner
        device, host = runner.device_copies - self._copies[0], runner.host_copies - self._copies[1]
        if device or host:
            self._metrics.gpu_batches(device + host, host)
        self._copies = (runner.device_copies, runner.host_copies)

    def encode(self, batch: ReadyBatch) -> bytes:
        """The serialized ``Batch`` message of ``batch`` for its transport (pixels
        inline, or a reference to the slot they are in)."""
        if batch.slot is None:
            raise ValueError("batch has no transport slot")
        meta = BatchMeta(batch.epoch, batch.cursor, batch.samples_per_rank, batch.keys, batch.labels,
                         batch.padding, batch.failed_keys)
        return self._ctx.sender.message(batch.slot, meta)

    @property
    def sender(self) -> BatchSender:
        """The stream's transport (daemon half)."""
        return self._ctx.sender

    @property
    def pipeline(self) -> PipelineSpec:
        """What the stream's pipeline was built as (device, device index, threads)."""
        return self._ctx.runner.spec

    @property
    def transport(self) -> str:
        """Which transport carries this stream's pixels (``shm``, ``grpc``, ...)."""
        return self._ctx.sender.kind.name.lower()

    def _ready(self, screened: Screened, images: Output, slot: Slot) -> ReadyBatch:
        split, batch = self._ctx.split, screened.batch
        self._filter.delivered(screened)
        if screened.failed:
            self._metrics.samples_failed(self._filter.bad.dataset, split.split, len(screened.failed))
        return ReadyBatch(
            epoch=batch.epoch,
            cursor=batch.cursor,
            samples_per_rank=self._ctx.samples_per_rank,
            keys=[split.keys[int(i)] for i in batch.indices],
            labels=split.labels[batch.indices],
            images=images,
            padding=batch.padding,
            slot=slot,
            failed_keys=[split.keys[i] for i in screened.failed],
        )
