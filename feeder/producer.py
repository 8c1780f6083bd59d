"""One open stream: a producer thread turns plan slices into ready batches (read ->
decode+augment) and puts them on a bounded queue; the consumer drains it.

The queue bound is the backpressure: a slow client fills its own queue, then its own
producer waits, and nothing grows. ``close()`` (client gone, shutdown, end) stops the
producer, empties the queue and returns the pipeline to its pool.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from core.errors import DataError, FeederError
from feeder.augment import AugmentKind, CropRange, sample_crops
from feeder.diagnose import name_bad_sample
from feeder.metrics import ServerMetrics
from feeder.pipeline import Job
from feeder.plan import BatchSlice
from shards.reader import SplitIndex

__all__ = ["BatchStream", "ReadyBatch"]

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
    images: np.ndarray
    padding: np.ndarray


class BatchRunner(Protocol):
    """What turns a stream's jobs into image batches: a DALI
    :class:`feeder.pipeline.PipelineRunner`, or one in front of the decoded cache
    (:class:`feeder.cached_runner.CachedRunner`)."""

    def run_many(self, batches: Iterable[Job]) -> Iterator[np.ndarray]: ...


@dataclass(frozen=True)
class StreamContext:
    """What a producer needs besides the plan: where bytes come from, what to run,
    and what draws each sample's crop window and flip (``kind``, ``seed``, ``crop``,
    with the batch's epoch and the samples' keys)."""

    split: SplitIndex
    runner: BatchRunner
    image_size: int
    samples_per_rank: int
    queue_batches: int
    kind: AugmentKind = AugmentKind.TRAIN
    seed: int = 0
    crop: CropRange = CropRange()


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
        self._slices = slices
        self._metrics = metrics
        self._on_close = on_close
        self._queue: queue.Queue = queue.Queue(maxsize=context.queue_batches)
        self._stop = threading.Event()
        self._healthy = True
        self._read_s = 0.0  # total seconds spent reading, to separate it from decoding
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._produce, name="feeder-producer", daemon=True)
        self.opened_s = time.monotonic()
        self.samples_sent = self.batches_sent = 0
        self.outcome = "cancelled"  # until the stream ends by itself or by an error

    def start(self) -> BatchStream:
        """Start the producer, unless the stream was closed first (daemon shutdown
        between registering the stream and starting it)."""
        with self._close_lock:
            if not self._closed:
                self._thread.start()
        return self

    def __iter__(self) -> Iterator[ReadyBatch]:
        while True:
            item = self._get()
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
        pending: deque[BatchSlice] = deque()
        try:
            outputs = self._ctx.runner.run_many(self._read_batches(pending))
            while True:
                started, read_before = time.perf_counter(), self._read_s
                images = next(outputs, None)
                if images is None:
                    break
                # Time blocked on DALI, less the reads of next batches done meanwhile.
                waited = time.perf_counter() - started - (self._read_s - read_before)
                self._metrics.stage("decode_augment", waited)
                if not self._put(self._ready(pending.popleft(), images)):
                    return
            self._put(_END)
        except DataError as e:
            self._healthy = False
            self._put(name_bad_sample(self._ctx.split, [int(i) for b in pending for i in b.indices], e))
        except FeederError as e:
            self._put(e)
        except Exception as e:  # noqa: BLE001 - a producer must report, never die silently
            self._healthy = False
            error = FeederError(f"stream failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._put(error)

    def _read_batches(self, pending: deque[BatchSlice]) -> Iterator[Job]:
        split, ctx = self._ctx.split, self._ctx
        upcoming = next(self._slices, None)
        while upcoming is not None and not self._stop.is_set():
            batch, upcoming = upcoming, next(self._slices, None)
            started = time.perf_counter()
            if upcoming is not None:
                split.will_need(upcoming.indices)  # one batch of read-ahead
            jpegs = split.read_many(batch.indices)
            crops = sample_crops(
                ctx.kind, ctx.seed, batch.epoch, [split.keys[int(i)] for i in batch.indices],
                split.widths[batch.indices], split.heights[batch.indices], ctx.crop,
            )
            seconds = time.perf_counter() - started
            self._read_s += seconds
            self._metrics.stage("read", seconds)
            pending.append(batch)
            yield Job(jpegs, ctx.image_size, crops, indices=batch.indices)

    def _ready(self, batch: BatchSlice, images: np.ndarray) -> ReadyBatch:
        split = self._ctx.split
        return ReadyBatch(
            epoch=batch.epoch,
            cursor=batch.cursor,
            samples_per_rank=self._ctx.samples_per_rank,
            keys=[split.keys[int(i)] for i in batch.indices],
            labels=split.labels[batch.indices],
            images=images,
            padding=batch.padding,
        )
