"""A built pipeline run on jobs: :class:`PipelineRunner` keeps up to ``prefetch`` of
them in flight in its decoder (:mod:`decode.registry` names it) and hands back one outcome per
job, in order (:mod:`decode.jobs`).

When a run fails, the runs behind it are finished first, and the failing samples are
located (:func:`decode.jobs.locate_failures`) before the failure is handed out: at
that moment nothing is in flight, so the caller can run a repaired job alone
(:meth:`PipelineRunner.run_alone`) and still deliver it before the outcomes behind
it. Usable without gRPC: the in-process baseline in ``bench/`` runs the same code.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Generator, Iterable, Iterator
from typing import Any

import numpy as np

from core.errors import ConfigError
from core.workers import FairPool, Lane
from decode.jobs import Allocate, Decoded, Failed, Job, JobT, Outcome, SampleDecodeError, locate_failures
from decode.look_ahead import DEFAULT_LOOKAHEAD
from decode.pipeline import PipelineSpec
from decode.registry import make_decoder
from transport.base import Slot, TransportClosed, host_slot

__all__ = ["PipelineRunner"]


class PipelineRunner:
    """One built pipeline. Not thread-safe: one stream (or one benchmark loop) owns a
    runner at a time.

    Args:
        spec: what to build.
        lane: where its CPU work runs (the daemon's shared workers); None: on
            ``spec.threads`` workers of its own.
    """

    # Decodes windows only: a job may bring a half-scale copy (shards.reader.SplitIndex.read_windows).
    decodes_half_copies = True

    def __init__(self, spec: PipelineSpec, lane: Lane | None = None) -> None:
        self.spec = spec
        self._own_workers: FairPool | None = None
        if lane is None:
            # Named apart from the daemon's pool ("feeder-decode"), whose threads are counted by name.
            self._own_workers = FairPool(spec.threads, name="feeder-runner")
            lane = self._own_workers.lane("runner")
        self.lane = lane
        self._decoder = make_decoder(spec, lane)
        self._in_flight: deque[tuple[Job, Any]] = deque()  # oldest first
        # Runs kept in flight: the spec's to begin with; may be changed between
        # runs (it takes effect at the next one started).
        self.prefetch = spec.prefetch
        # Jobs taken beyond those in flight, whose slow samples the decoder may
        # decode early (:mod:`decode.look_ahead`); 0: none.
        self.lookahead = DEFAULT_LOOKAHEAD
        self._coming: deque[Job] = deque()  # taken, not yet started, oldest first
        # Set when a run failed for another reason than its samples, or the decoder
        # raised: the pool builds a new runner rather than trust this one again.
        self.broken = False

    @property
    def device_copies(self) -> int:
        """GPU outputs written device to device (into a CUDA IPC slot)."""
        return self._decoder.device_copies

    @property
    def host_copies(self) -> int:
        """GPU outputs copied through host memory."""
        return self._decoder.host_copies

    @property
    def decoded_early(self) -> int:
        """Slow samples whose decoding started ahead of their batch (:mod:`decode.look_ahead`)."""
        return self._decoder.decoded_early

    @property
    def jobs_ahead(self) -> int:
        """At most how many jobs it takes beyond the one it finishes next: those in
        flight and those it may look ahead at (where its decoder decodes slow samples
        early, while they come)."""
        return max(1, self.prefetch) + (self.lookahead if self._decoder.can_look_ahead else 0)

    def held(self, indices: np.ndarray, image_size: int) -> np.ndarray | None:
        """None: it decodes every sample from its bytes."""
        return None

    def run(self, job: Job) -> np.ndarray:
        """Decode and augment one job into host memory.

        Returns:
            uint8 ``[len(job), image_size, image_size, 3]``.

        Raises:
            SampleDecodeError: samples did not decode (``failures`` names them).
        """
        outcome = self.run_alone(job)
        if isinstance(outcome, Failed):
            raise outcome.error
        return outcome.slot.array

    def run_many(self, jobs: Iterable[JobT], allocate: Allocate = host_slot) -> Generator[Outcome[JobT], None, None]:
        """One outcome per job, in order, keeping up to ``prefetch`` in flight.
        Nothing is in flight when a :class:`Failed` is handed out.

        Args:
            jobs: the jobs.
            allocate: supplies the slot each decoded batch is written into (e.g. a
                transport's, so the pixels are written where they leave); called
                only for jobs that decode. On the GPU a device slot is written device
                to device; a host slot costs a copy to host memory (``host_copies``).

        Raises:
            SampleDecodeError: a run failed although each of its samples decodes
                alone (nothing to blame on a sample).
        """
        pending = iter(jobs)
        if self._coming:  # taken by a run_many left unfinished: not wanted any more
            self._coming.clear()
            self._decoder.release_buffers()
        while True:
            self._fill(pending)
            if not self._in_flight:
                return
            job, result = self._finish_oldest(allocate)
            if not isinstance(result, SampleDecodeError):
                yield self._outcome(job, result)
                continue
            behind = [self._finish_oldest(allocate) for _ in range(len(self._in_flight))]
            for late_job, late in [(job, result), *behind]:
                yield self._outcome(late_job, late)

    def run_alone(self, job: JobT, allocate: Allocate = host_slot) -> Outcome[JobT]:
        """The outcome of ``job`` run by itself (nothing may be in flight: between
        outcomes of :meth:`run_many`, after a failure, or outside it)."""
        if self._in_flight:
            raise ConfigError(f"run_alone with {len(self._in_flight)} runs in flight")
        self._start(job)
        return self._outcome(job, self._finish_oldest(allocate)[1])

    def _fill(self, pending: Iterator[Job]) -> None:
        while len(self._in_flight) < max(1, self.prefetch):
            job = self._coming.popleft() if self._coming else next(pending, None)
            if job is None:
                return
            self._start(job)
        if not self._decoder.looks_ahead:
            return
        while len(self._coming) < self.lookahead:
            job = next(pending, None)
            if job is None:
                return
            self._check(job)
            self._coming.append(job)
            self._decoder.ahead(job)

    def _check(self, job: Job) -> None:
        if not 1 <= len(job) <= self.spec.max_batch_size:
            raise ConfigError(f"batch of {len(job)} outside 1..{self.spec.max_batch_size}")
        if len(job.crops) != len(job):
            raise ConfigError(f"crops: {len(job.crops)} windows for {len(job)} samples")

    def _start(self, job: Job) -> None:
        self._check(job)
        self._in_flight.append((job, self._decoder.start(job)))

    def _finish_oldest(self, allocate: Allocate | None) -> tuple[Any, Slot | SampleDecodeError | None]:
        """The oldest job and its slot (None without ``allocate``) or its error."""
        job, started = self._in_flight.popleft()
        try:
            slot = self._decoder.finish(started, allocate)
            if slot is not None:
                # Every write of the batch is enqueued now: its ready event goes here, not
                # where it is sent, which would also cover the runs enqueued after it.
                slot.seal()
            return job, slot
        except SampleDecodeError as e:
            return job, e
        except TransportClosed:
            raise  # the stream was closed while its batch waited for a slot: the pipeline is fine
        except BaseException:
            self.broken = True
            raise

    def _outcome(self, job: JobT, result: Slot | SampleDecodeError | None) -> Outcome[JobT]:
        if isinstance(result, SampleDecodeError):
            try:
                return Failed(job, locate_failures(job, result, self._decodes_alone))
            except SampleDecodeError:
                self.broken = True
                raise
        if result is None:
            raise ConfigError("a decoded run without a slot")
        return Decoded(job, result)

    def _decodes_alone(self, job: Job) -> bool:
        self._start(job)
        return not isinstance(self._finish_oldest(None)[1], SampleDecodeError)

    def drain(self) -> None:
        """Finish and drop every run still in flight (a stream stopped early), and
        give back the buffers kept from run to run: an idle runner holds nothing that
        grows with its batches."""
        while self._in_flight:
            self._finish_oldest(None)
        self._coming.clear()
        self._decoder.release_buffers()  # and forgets the samples it was decoding early

    def close(self) -> None:
        """Release the decoder's threads and buffers now, not whenever the runner is
        collected. The runner cannot run after this."""
        self._decoder.close()
        self.lane.close()
        if self._own_workers is not None:
            self._own_workers.close()

