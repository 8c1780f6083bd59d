"""What turns a job's encoded samples into its output batch: one :class:`Decoder`
interface, four implementations, chosen once when a pipeline is built
(:func:`make_decoder`).

- :class:`TurboDecoder` (CPU, libjpeg-turbo): only each crop window is decoded by
  :mod:`shards.jpeg` (rows and columns cropped before the IDCT and, on the sharder's
  JPEGs with restart markers, before the entropy decoding too; at a reduced DCT scale
  where the window is at least twice the output), then the CPU finishing stage
  (:class:`decode.finish.Finisher`: the GIL-free C resize of ``decode/_resize.c``,
  mirroring as it resizes; OpenCV's, image by image, where that library was not
  built) finishes the batch on the workers.
  Per window on one core: 0.25 ms (0.32 without restart markers) where DALI's
  ``decoders.image_slice`` takes 0.43. Into a device slot it writes through pinned
  staging memory and an upload on the slot's stream.
- :class:`DaliCpuDecoder` (CPU, where the window decoder was not built): DALI's ROI
  decode, then the same finishing stage (DALI's CPU resize costs ~1.2 ms per image).
- :class:`DaliGpuDecoder`: ``mixed`` ROI decode (nvJPEG, ``hw_decoder_load`` of it on
  the hardware JPEG engines) on the stream's device, then the finishing stage in its
  DALI graph there (:func:`decode.finish.finish_graph`); a batch whose slot is on a
  GPU (a CUDA IPC slot) is copied device to device on the slot's stream, never through
  host memory, and nothing waits on the host.
- :class:`decode.split_decoder.SplitDecoder`: a GPU pipeline's batches split between
  the first two, the CPU's share tuned from what it measures.

A decoder starts runs and finishes them in the order they were started; finishing
waits for the run (:meth:`collect`, which raises :class:`decode.jobs.SampleDecodeError`
for a run whose samples failed), then writes it into its slot (:meth:`write`).
"""

from __future__ import annotations

from typing import Any, Protocol

import numpy as np

from core.workers import Lane
from decode import finish
from decode.finish import Finisher
from decode.jobs import Allocate, Job, SampleDecodeError
from decode.look_ahead import LookAhead
from decode.pipeline import ANCHORS, JPEGS, SHAPES, PipelineSpec, build_dali, dali_decode_error
from shards import jpeg
from transport.base import Slot

__all__ = ["DaliCpuDecoder", "DaliGpuDecoder", "Decoder", "PhasedDecoder", "TurboDecoder", "make_decoder"]


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


def make_decoder(spec: PipelineSpec, lane: Lane) -> Decoder:
    """The decoder ``spec`` asks for (see the module doc); its CPU work runs on
    ``lane`` (DALI's own decoding on DALI's ``spec.threads`` threads)."""
    if spec.device == "gpu":
        gpu = DaliGpuDecoder(spec)
        if spec.cpu_decode_share == 0 or not jpeg.available():
            return gpu
        from decode.split_decoder import CpuShare, SplitDecoder

        return SplitDecoder(TurboDecoder(spec, lane), gpu, CpuShare(spec.cpu_decode_share))
    if spec.decoder == "libjpeg-turbo":
        return TurboDecoder(spec, lane)
    return DaliCpuDecoder(spec, lane)


def _shape(job: Job) -> tuple[int, int, int, int]:
    return (len(job), job.image_size, job.image_size, 3)


class PhasedDecoder:
    """``finish`` as two phases: :meth:`collect` waits for the run (and raises for
    its failed samples), :meth:`write` puts it into its slot; a run nobody wants, or
    whose slot could not be had, is given up with :meth:`discard`."""

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


class TurboDecoder(PhasedDecoder):
    """The libjpeg-turbo window decoder and the finishing stage, both on ``lane``."""

    device_copies = host_copies = 0

    can_look_ahead = True

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        # Buffers of the runs in flight and of the one being resized.
        self._windows = jpeg.WindowDecoder(lane, arenas=spec.prefetch + 1)
        self._finisher = Finisher(lane, spec.antialias)
        self._ahead = LookAhead(self._submit_early)
        self._staging: Any = None  # PinnedStaging, for device slots (made when first needed)
        self.uploads = 0  # batches written into a device slot through pinned memory

    @property
    def decoded_early(self) -> int:
        """Windows decoded ahead of their batches, in all."""
        return self._ahead.submitted

    @property
    def looks_ahead(self) -> bool:
        return self._ahead.wanted  # while slow samples come

    def ahead(self, job: Job) -> None:
        self._ahead.add(job)

    def start(self, job: Job) -> _Started:
        early = self._ahead.take(job)
        self._ahead.tick()
        rest = None if not early else [i for i in range(len(job)) if i not in early]
        return job, self._windows.submit(job.jpegs, job.crops.boxes, _scales(job), positions=rest), early

    def _submit_early(self, job: Job, position: int) -> jpeg.BatchDecode:
        return self._windows.submit(job.jpegs, job.crops.boxes, _scales(job), positions=[position], own_buffers=True)

    def collect(self, started: _Started) -> _Collected:
        job, decoding, early = started
        try:
            windows, failed = decoding.result()
            for position, ahead in early.items():
                ahead_windows, ahead_failed = ahead.result()
                windows[position] = ahead_windows[position]
                failed.update(ahead_failed)
        except BaseException:
            self._windows.recycle(decoding)
            raise
        if failed:
            self._windows.recycle(decoding)
            first = min(failed)
            more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
            raise SampleDecodeError(f"{failed[first]}{more}", dict(failed))
        return job, decoding, windows

    def shape(self, collected: _Collected) -> tuple[int, int, int, int]:
        return _shape(collected[0])

    def write(self, collected: _Collected, slot: Slot) -> None:
        job, decoding, windows = collected
        try:
            if slot.tensor.device.type == "cpu":
                self._finisher.finish(windows, job.image_size, job.crops, out=slot.array)
            else:
                self._upload(job, windows, slot)
        finally:
            self._windows.recycle(decoding)

    def _upload(self, job: Job, windows: list[np.ndarray], slot: Slot) -> None:
        """Finishes into pinned memory, then enqueues its copy into the device slot on
        the slot's stream (no SM time, no host wait)."""
        import torch

        from decode.device_writes import PinnedStaging, upload

        if self._staging is None:
            self._staging = PinnedStaging()
        stream = slot.stream or torch.cuda.current_stream(slot.tensor.device)
        nbytes = slot.tensor.numel()
        staging = self._staging.take(nbytes)[:nbytes]
        pixels = staging.numpy().reshape(tuple(slot.tensor.shape))
        self._finisher.finish(windows, job.image_size, job.crops, out=pixels)
        upload(staging, slot.tensor, stream)
        self._staging.give(staging, stream)
        self.uploads += 1

    def discard(self, collected: _Collected) -> None:
        self._windows.recycle(collected[1])

    def release_buffers(self) -> None:
        self._ahead.drop()
        self._windows.release_buffers()
        if self._staging is not None:
            self._staging.clear()

    def close(self) -> None:
        self.release_buffers()  # the threads are the lane's


# A started run of the window decoder: its job, its batch's decoding, and its windows
# decoded ahead of it (position -> their decoding).
_Started = tuple[Job, jpeg.BatchDecode, dict[int, jpeg.BatchDecode]]
# A collected one: its job, its decoding (recycled once written) and its windows.
_Collected = tuple[Job, jpeg.BatchDecode, list[np.ndarray]]


def _scales(job: Job) -> np.ndarray:
    """Each window's DCT scale denominator (:func:`shards.jpeg.dct_denominator`)."""
    return np.array([jpeg.dct_denominator(int(w), int(h), job.image_size) for w, h in job.crops.boxes[:, 2:]])


def _feed(pipe: Any, job: Job, gpu: bool) -> None:
    boxes = job.crops.boxes.astype(np.float32)
    pipe.feed_input(JPEGS, list(job.jpegs))
    pipe.feed_input(ANCHORS, list(boxes[:, :2]))
    pipe.feed_input(SHAPES, list(boxes[:, 2:]))
    if gpu:
        finish.feed(pipe, job.image_size, job.crops)
    pipe.schedule_run()


def _outputs(pipe: Any, job: Job, stream: Any = None) -> Any:
    try:
        (out,) = pipe.outputs() if stream is None else pipe.outputs(cuda_stream=stream)
    except RuntimeError as e:
        raise dali_decode_error(e, len(job)) from e
    return out


def _shutdown(pipe: Any) -> None:
    shutdown = getattr(pipe, "_shutdown", None)  # what Pipeline.__del__ calls
    if shutdown is not None:
        shutdown()


class _DaliDecoder(PhasedDecoder):
    """What both DALI decoders share: feeding a run, collecting it in order."""

    gpu = False
    can_look_ahead = looks_ahead = False  # a DALI run decodes its batch as one
    decoded_early = 0

    def ahead(self, job: Job) -> None:
        pass

    def __init__(self, spec: PipelineSpec) -> None:
        self._pipe = build_dali(spec)

    def start(self, job: Job) -> Job:
        _feed(self._pipe, job, gpu=self.gpu)
        return job

    def collect(self, job: Job) -> tuple[Job, Any]:
        return job, _outputs(self._pipe, job)

    def shape(self, collected: tuple[Job, Any]) -> tuple[int, int, int, int]:
        return _shape(collected[0])

    def write(self, collected: tuple[Job, Any], slot: Slot) -> None:
        raise NotImplementedError

    def release_buffers(self) -> None:
        pass  # DALI keeps its peak buffers while the pipeline lives

    def close(self) -> None:
        _shutdown(self._pipe)


class DaliCpuDecoder(_DaliDecoder):
    """DALI's CPU ROI decode (on DALI's ``spec.threads`` threads) and the finishing
    stage (on ``lane``)."""

    device_copies = host_copies = 0

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        super().__init__(spec)
        self._finisher = Finisher(lane, spec.antialias)

    def write(self, collected: tuple[Job, Any], slot: Slot) -> None:
        job, out = collected
        windows = [np.asarray(out[i]) for i in range(len(out))]
        self._finisher.finish(windows, job.image_size, job.crops, out=slot.array)


class DaliGpuDecoder(_DaliDecoder):
    """nvJPEG ROI decode and the finishing stage on the stream's GPU. Its outputs are
    bound to a stream of its own; a device slot is written on the slot's stream after
    it, and the output is kept until that copy is done (:class:`Held`): no host wait."""

    gpu = True

    def __init__(self, spec: PipelineSpec) -> None:
        import torch

        from decode.device_writes import Held

        super().__init__(spec)
        self.device_copies = self.host_copies = 0
        with torch.cuda.device(spec.device_id):
            self._stream = torch.cuda.Stream(spec.device_id, priority=0)  # CUDA's lowest priority
        self._held = Held()

    def collect(self, job: Job) -> tuple[Job, Any]:
        return job, _outputs(self._pipe, job, self._stream)

    def write(self, collected: tuple[Job, Any], slot: Slot) -> None:
        import torch

        from decode.device_writes import copy_dali_output

        _, out = collected
        if slot.tensor.device.type != "cuda":
            np.copyto(slot.array, out.as_cpu().as_array())
            self.host_copies += 1
            return
        stream = slot.stream or torch.cuda.current_stream(slot.tensor.device)
        stream.wait_stream(self._stream)  # DALI's work on the run, as its outputs are bound here
        copy_dali_output(out, slot.tensor, stream)
        self._stream.wait_stream(stream)  # what DALI does with the buffer next comes after the copy
        self._held.hold(stream, out)
        self.device_copies += 1

    def release_buffers(self) -> None:
        self._held.drain()

    def close(self) -> None:
        self._held.drain()
        super().close()
