"""What turns a job's encoded samples into its output batch: the :class:`Decoder`
interface every pipeline's decoder offers, and :class:`PhasedDecoder`, the base of
those the registry names (:mod:`decode.registry`: one module each).

A decoder starts runs and finishes them in the order they were started; finishing
waits for the run (:meth:`PhasedDecoder.collect`, which raises
:class:`decode.jobs.SampleDecodeError` for a run whose samples failed), then writes it
into its slot (:meth:`PhasedDecoder.write`), through the finishing stage
(:mod:`decode.finish`) that every decode path ends in.
"""

from __future__ import annotations

from typing import Any, ClassVar, Protocol

from core.workers import Lane
from decode.jobs import Allocate, Job
from decode.pipeline import PipelineSpec
from transport.base import Slot

__all__ = ["Decoder", "PhasedDecoder", "batch_shape"]


class Decoder(Protocol):
    """Decodes, crops, resizes and mirrors jobs; runs finish in the order started."""

    @property
    def device_copies(self) -> int:
        """GPU outputs written into a device slot."""

    @property
    def host_copies(self) -> int:
        """GPU outputs copied through host memory."""

    @property
    def decoded_early(self) -> int:
        """Slow samples whose decoding started ahead of their batch."""

    can_look_ahead: bool  # whether :meth:`ahead` may do anything

    @property
    def looks_ahead(self) -> bool:
        """Whether it wants the jobs after those in flight now (:meth:`ahead`)."""

    def ahead(self, job: Job) -> None:
        """``job`` will be started after those in flight: slow samples of it may be
        decoded ahead (:mod:`decode.look_ahead`)."""

    def start(self, job: Job) -> Any:
        """Starts decoding ``job``; returns what :meth:`finish` takes."""

    def finish(self, started: Any, allocate: Allocate | None) -> Slot | None:
        """Waits for the oldest run started (``started``, what its :meth:`start`
        returned) and writes its batch into ``allocate(shape)``; None, without
        writing, when ``allocate`` is None (a run nobody wants).

        Raises:
            SampleDecodeError: some of its samples did not decode.
        """

    def release_buffers(self) -> None:
        """Gives back buffers kept from run to run (nothing in flight): an idle
        pipeline holds nothing that grows with its batches."""

    def close(self) -> None:
        """Frees threads and buffers now; the decoder cannot run after this."""


def batch_shape(job: Job) -> tuple[int, int, int, int]:
    """The shape of ``job``'s batch: uint8 ``[N, size, size, 3]``."""
    return (len(job), job.image_size, job.image_size, 3)


class PhasedDecoder:
    """``finish`` as two phases: :meth:`collect` waits for the run (and raises for
    its failed samples), :meth:`write` puts it into its slot; a run nobody wants, or
    whose slot could not be had, is given up with :meth:`discard`.

    A subclass is built from the pipeline's spec and the lane its CPU work runs on
    (``Kind(spec, lane)``); the registry reads its class attributes: where it decodes
    (``device``), whether it decodes on threads of its own rather than the lane
    (``own_threads``: DALI's, a share of the daemon's budget) and, from
    :meth:`unavailable_reason`, whether it can run here. A decoder that writes no GPU
    output and decodes nothing early keeps the counters' zeros below.
    """

    device: ClassVar[str] = "cpu"  # "cpu" or "gpu": where its batches are decoded
    own_threads: ClassVar[bool] = False
    device_copies = host_copies = 0  # GPU outputs written into a device slot, or through host memory
    can_look_ahead = False

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        """Built for ``spec``, its CPU work on ``lane``."""

    @classmethod
    def unavailable_reason(cls) -> str | None:
        """Why it cannot run here (a library not built, say); None: it can."""
        return None

    @property
    def decoded_early(self) -> int:
        """Slow samples whose decoding started ahead of their batch: none."""
        return 0

    @property
    def looks_ahead(self) -> bool:
        """Whether it wants the jobs after those in flight: no."""
        return False

    def ahead(self, job: Job) -> None:
        """Nothing: it decodes each batch when it starts."""

    def start(self, job: Job) -> Any:
        raise NotImplementedError

    def collect(self, started: Any) -> Any:
        raise NotImplementedError

    def write(self, collected: Any, slot: Slot) -> None:
        raise NotImplementedError

    def discard(self, collected: Any) -> None:
        """Gives back what a collected run holds, without writing it."""

    def shape(self, collected: Any) -> tuple[int, int, int, int]:
        raise NotImplementedError

    def release_buffers(self) -> None:
        """Gives back buffers kept from run to run."""

    def close(self) -> None:
        """Frees threads and buffers now."""

    def finish(self, started: Any, allocate: Allocate | None) -> Slot | None:
        collected = self.collect(started)
        if allocate is None:
            self.discard(collected)
            return None
        try:
            slot = allocate(self.shape(collected))
        except BaseException:
            self.discard(collected)
            raise
        self.write(collected, slot)
        return slot


