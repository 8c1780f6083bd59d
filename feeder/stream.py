"""One open stream: a producer thread turns the plan's slices into ready batches
(:class:`feeder.producer.Producer`) and puts them on a bounded queue; the consumer
(the servicer, or an in-process reader) drains it.

The queue bound is the backpressure: a slow client fills its own queue, then its own
producer waits, and nothing grows. Who waits on whom is counted both ways, apart:
``consumer_wait_s``, the producer held by its consumer (a full queue, or a ring whose
slots are all lent: queued, being sent or held by the client), and ``starved_s``, the
consumer waiting for a batch while the producer was not held (the daemon behind).

A stream owns what it was opened with (its pipeline, its transport, its admission
ticket, as an :class:`~contextlib.ExitStack`) and :meth:`BatchStream.close` gives all
of it back, in one place, whatever ended it.
"""

from __future__ import annotations

import enum
import queue
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager

from core.errors import FeederError
from decode.pipeline import PipelineSpec
from feeder.metrics import ServerMetrics
from feeder.producer import Producer, ReadyBatch, StreamContext
from feeder.ready_queue import ReadyQueue, item_bytes
from protocol.plan import BatchSlice
from transport.base import BatchSender, Slot, TransportClosed

__all__ = ["BatchStream", "StreamOutcome"]

_POLL_S = 0.1  # how often blocked queue operations look at the stop flag
_END = object()


class _HeldClock:
    """Seconds a producer has been held by its consumer, the hold under way included.
    Thread-safe: the producer holds, the consumer's thread reads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._total_s = 0.0
        self._since: float | None = None

    @contextmanager
    def held(self) -> Iterator[None]:
        with self._lock:
            self._since = time.monotonic()
        try:
            yield
        finally:
            with self._lock:
                self._total_s += time.monotonic() - (self._since or 0.0)
                self._since = None

    def total_s(self) -> float:
        with self._lock:
            return self._total_s + (time.monotonic() - self._since if self._since is not None else 0.0)


class StreamOutcome(enum.Enum):
    """How a stream ended (``OPEN`` until it does)."""

    OPEN = "open"
    FINISHED = "finished"  # every batch of its plan was taken
    CANCELLED = "cancelled"  # the client went away, or the daemon shut down
    IDLE = "idle"  # cancelled by the daemon: the client took no batch for too long
    FAILED = "failed"  # an error ended it (the client got its status)


class BatchStream:
    """Producer thread + bounded queue for one stream. Iterate to receive batches;
    iteration raises the :class:`FeederError` that ended the stream, if any.

    Args:
        context: split, runner, sizes and policy.
        sender: the stream's transport (daemon half): the producer writes into its
            slots.
        slices: the plan's batches for this stream.
        metrics: daemon counters.
        label: the stream's name in per-stream metrics (unique in the daemon).
    """

    def __init__(
        self,
        context: StreamContext,
        sender: BatchSender,
        slices: Iterator[BatchSlice],
        metrics: ServerMetrics,
        label: str = "",
    ) -> None:
        self.label = label
        self.context = context
        self.sender = sender
        self._producer = Producer(context, metrics)
        lane = context.runner.lane  # pooled with its pipeline: counted from here on
        self._lane_start_s = (lane.busy_s, lane.cpu_s)
        self._slices = slices
        self._metrics = metrics
        self._resources = ExitStack()  # what the stream owns (see own())
        self._queue = ReadyQueue(context.queue_batches, context.queue_bytes)
        self._stop = threading.Event()
        self._closed = False
        self._close_lock = threading.Lock()
        self._thread = threading.Thread(target=self._produce, name="feeder-producer", daemon=True)
        self.opened_s = time.monotonic()
        # When the consumer last took a batch; None while it waits for the next one.
        self._taken_s: float | None = self.opened_s
        self.samples_sent = self.batches_sent = 0
        self._held = _HeldClock()  # the producer held by its consumer
        self.starved_s = 0.0  # how long the consumer has waited for a batch the producer was behind on
        self.outcome = StreamOutcome.OPEN
        self.detail = ""  # what ended it, for the log (an error, an idle timeout)

    def own(self, resources: ExitStack) -> None:
        """Take ``resources`` (what the stream was opened with: pipeline, transport,
        admission); :meth:`close` releases them, last in first out."""
        self._resources.push(resources)

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

    @property
    def consumer_wait_s(self) -> float:
        """Seconds ready batches have waited for the consumer since the stream opened:
        the producer held by a full ready queue, or by a ring whose every slot is lent
        (queued, being sent, or held by the client)."""
        return self._held.total_s()

    def __iter__(self) -> Iterator[ReadyBatch]:
        while True:
            asked, self._taken_s, held_s = time.monotonic(), None, self._held.total_s()
            item = self._get()
            self._taken_s = time.monotonic()
            # Waiting on a producer that waits on the client's slots is not starvation.
            self.starved_s += max(0.0, self._taken_s - asked - (self._held.total_s() - held_s))
            if item is _END:
                if not self._stop.is_set():
                    self._end(StreamOutcome.FINISHED)
                return
            if isinstance(item, FeederError):
                self._end(StreamOutcome.FAILED, f"{type(item).__name__}: {item}")
                raise item
            if not isinstance(item, ReadyBatch):
                raise TypeError(f"unexpected queue item {item!r}")
            # Counted as it is handed on, not once the next is asked for: a client that
            # stops after its last batch and asks for the counters must find it counted.
            self._metrics.batch_sent(len(item.meta), item.images.nbytes)
            self.samples_sent += len(item.meta)
            self.batches_sent += 1
            waited = time.perf_counter()
            yield item
            self._metrics.stage("send", time.perf_counter() - waited)

    @property
    def prefetch(self) -> int:
        """Pipeline runs its runner keeps in flight; set between runs (the tuner)."""
        return self.context.runner.prefetch

    @prefetch.setter
    def prefetch(self, runs: int) -> None:
        self.context.runner.prefetch = runs

    @property
    def queue_fill(self) -> float:
        """Share of the ready queue filled now (by batches)."""
        return len(self._queue) / self.context.queue_batches

    @property
    def busy_s(self) -> float:
        """Seconds of the daemon's decode threads this stream has used since it
        opened (wall time on the workers: what it kept them from others)."""
        return self.context.runner.lane.busy_s - self._lane_start_s[0]

    @property
    def cpu_s(self) -> float:
        """CPU seconds of the daemon's decode threads this stream has used since it
        opened."""
        return self.context.runner.lane.cpu_s - self._lane_start_s[1]

    @property
    def pipeline(self) -> PipelineSpec:
        """What the stream's pipeline was built as (device, device index, threads)."""
        return self.context.runner.spec

    def encode(self, batch: ReadyBatch) -> bytes:
        """The serialized ``Batch`` message of ``batch`` for its transport (pixels
        inline, or a reference to the slot they are in)."""
        return self.sender.message(batch.slot, batch.meta)

    def mark_idle(self, detail: str) -> None:
        """Say the stream ends because its client took no batch for too long (before
        its call is cancelled and it is closed)."""
        self._end(StreamOutcome.IDLE, detail)

    def close(self) -> None:
        """Stop the producer, drop queued batches, give back everything the stream
        owns. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
            started = self._thread.ident is not None
        self._end(StreamOutcome.CANCELLED)
        self._stop.set()
        self.sender.close()  # a producer waiting for a free slot stops waiting
        self._drain_queue()
        if started:
            self._thread.join()
        self._drain_queue()
        self._resources.close()

    def _end(self, outcome: StreamOutcome, detail: str = "") -> None:
        if self.outcome is StreamOutcome.OPEN:
            self.outcome, self.detail = outcome, detail

    def _get(self) -> object:
        while not self._stop.is_set():
            try:
                item = self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            self._dequeued(item)
            return item
        return _END

    def _put(self, item: object) -> bool:
        with self._held.held():
            while not self._stop.is_set():
                try:
                    self._queue.put(item, timeout=_POLL_S)
                except queue.Full:
                    continue
                if isinstance(item, ReadyBatch):
                    self._metrics.batch_queued(item_bytes(item))
                return True
        return False

    def _drain_queue(self) -> None:
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                return
            self._dequeued(item)

    def _dequeued(self, item: object) -> None:
        if isinstance(item, ReadyBatch):
            self._metrics.batch_dequeued(item_bytes(item))

    def _slot_for(self, shape: tuple[int, ...]) -> Slot:
        """A slot of the stream's transport (waits while its ring is full: the
        client's backpressure, counted as the consumer's wait)."""
        with self._held.held():
            return self.sender.slot_for(shape)

    def _produce(self) -> None:
        try:
            with closing(self._producer.batches(self._slices, self._slot_for)) as batches:
                for batch in batches:
                    if not self._put(batch):
                        return
            self._put(_END)
        except TransportClosed:
            return  # closed while waiting for a slot: nobody reads any more
        except FeederError as e:  # names what failed (a sample, a shard, a budget)
            self._put(e)
        except Exception as e:  # noqa: BLE001 - a producer must report, never die silently
            error = FeederError(f"stream failed: {type(e).__name__}: {e}")
            error.__cause__ = e
            self._put(error)
