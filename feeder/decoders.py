"""What turns a job's encoded samples into its output batch: one :class:`Decoder`
interface, three implementations, chosen once when a pipeline is built
(:func:`make_decoder`).

- :class:`TurboDecoder` (CPU, libjpeg-turbo): only each crop window is decoded by
  :mod:`shards.jpeg` (rows and columns cropped before the IDCT and, on the sharder's
  JPEGs with restart markers, before the entropy decoding too; at a reduced DCT scale
  where the window is at least twice the output), then OpenCV resizes and mirrors the
  batch (:class:`feeder.resize.BatchResizer`). Per window on one core: 0.25 ms (0.32
  without restart markers) where DALI's ``decoders.image_slice`` takes 0.43.
- :class:`DaliCpuDecoder` (CPU, where the window decoder was not built): DALI's ROI
  decode, then the same OpenCV resize (DALI's CPU resize costs ~1.2 ms per image
  where OpenCV takes ~0.12 ms).
- :class:`DaliGpuDecoder`: ``mixed`` ROI decode (nvJPEG) on the stream's device, then
  DALI's resize and flip there; a batch whose slot is on a GPU (a CUDA IPC slot) is
  copied device to device, never through host memory.

A decoder starts runs and finishes them in the order they were started; finishing
raises :class:`feeder.jobs.SampleDecodeError` for a run whose samples failed.
"""

from __future__ import annotations

import ctypes
from typing import Any, Protocol

import numpy as np

from core.errors import FeederError
from core.workers import Lane
from feeder.jobs import Allocate, Job, SampleDecodeError
from feeder.look_ahead import LookAhead
from feeder.pipeline import ANCHORS, FLIPS, JPEGS, SHAPES, SIZES, PipelineSpec, build_dali, dali_decode_error
from feeder.resize import BatchResizer
from shards import jpeg
from transport.base import Slot

__all__ = ["DaliCpuDecoder", "DaliGpuDecoder", "Decoder", "TurboDecoder", "make_decoder"]


class Decoder(Protocol):
    """Decodes, crops, resizes and mirrors jobs; runs finish in the order started."""

    device_copies: int  # GPU outputs written into a device slot
    host_copies: int  # GPU outputs copied through host memory

    @property
    def decoded_early(self) -> int:
        """Slow samples whose decoding started ahead of their batch."""

    can_look_ahead: bool  # whether :meth:`ahead` may do anything

    @property
    def looks_ahead(self) -> bool:
        """Whether it wants the jobs after those in flight now (:meth:`ahead`)."""

    def ahead(self, job: Job) -> None:
        """``job`` will be started after those in flight: slow samples of it may be
        decoded ahead (:mod:`feeder.look_ahead`)."""

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
        return DaliGpuDecoder(spec)
    if spec.decoder == "libjpeg-turbo":
        return TurboDecoder(spec, lane)
    return DaliCpuDecoder(spec, lane)


def _shape(job: Job) -> tuple[int, int, int, int]:
    return (len(job), job.image_size, job.image_size, 3)


class TurboDecoder:
    """The libjpeg-turbo window decoder and OpenCV's resize, both on ``lane``."""

    device_copies = host_copies = 0

    can_look_ahead = True

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        # Buffers of the runs in flight and of the one being resized.
        self._windows = jpeg.WindowDecoder(lane, arenas=spec.prefetch + 1)
        self._resizer = BatchResizer(lane)
        self._antialias = spec.antialias
        self._ahead = LookAhead(self._submit_early)

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

    def finish(self, started: _Started, allocate: Allocate | None) -> Slot | None:
        job, decoding, early = started
        try:
            windows, failed = decoding.result()
            for position, ahead in early.items():
                ahead_windows, ahead_failed = ahead.result()
                windows[position] = ahead_windows[position]
                failed.update(ahead_failed)
            if failed:
                first = min(failed)
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                raise SampleDecodeError(f"{failed[first]}{more}", dict(failed))
            if allocate is None:
                return None
            slot = allocate(_shape(job))
            self._resizer.resize(windows, job.image_size, job.crops.flips, self._antialias, out=slot.array)
            return slot
        finally:
            self._windows.recycle(decoding)

    def release_buffers(self) -> None:
        self._ahead.drop()
        self._windows.release_buffers()

    def close(self) -> None:
        self.release_buffers()  # the threads are the lane's


# A started run of the window decoder: its job, its batch's decoding, and its windows
# decoded ahead of it (position -> their decoding).
_Started = tuple[Job, jpeg.BatchDecode, dict[int, jpeg.BatchDecode]]


def _scales(job: Job) -> np.ndarray:
    """Each window's DCT scale denominator (:func:`shards.jpeg.dct_denominator`)."""
    return np.array([jpeg.dct_denominator(int(w), int(h), job.image_size) for w, h in job.crops.boxes[:, 2:]])


def _feed(pipe: Any, job: Job, gpu: bool) -> None:
    boxes = job.crops.boxes.astype(np.float32)
    pipe.feed_input(JPEGS, list(job.jpegs))
    pipe.feed_input(ANCHORS, list(boxes[:, :2]))
    pipe.feed_input(SHAPES, list(boxes[:, 2:]))
    if gpu:
        pipe.feed_input(SIZES, [np.array([job.image_size], dtype=np.float32)] * len(job))
        pipe.feed_input(FLIPS, list(job.crops.flips.astype(np.int32)))
    pipe.schedule_run()


def _outputs(pipe: Any, job: Job) -> Any:
    try:
        (out,) = pipe.outputs()
    except RuntimeError as e:
        raise dali_decode_error(e, len(job)) from e
    return out


def _shutdown(pipe: Any) -> None:
    shutdown = getattr(pipe, "_shutdown", None)  # what Pipeline.__del__ calls
    if shutdown is not None:
        shutdown()


class _DaliDecoder:
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

    def finish(self, job: Job, allocate: Allocate | None) -> Slot | None:
        out = _outputs(self._pipe, job)
        if allocate is None:
            return None
        slot = allocate(_shape(job))
        self._write(out, job, slot)
        return slot

    def _write(self, out: Any, job: Job, slot: Slot) -> None:
        raise NotImplementedError

    def release_buffers(self) -> None:
        pass  # DALI keeps its peak buffers while the pipeline lives

    def close(self) -> None:
        _shutdown(self._pipe)


class DaliCpuDecoder(_DaliDecoder):
    """DALI's CPU ROI decode (on DALI's ``spec.threads`` threads) and OpenCV's resize
    (on ``lane``)."""

    device_copies = host_copies = 0

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        super().__init__(spec)
        self._resizer = BatchResizer(lane)
        self._antialias = spec.antialias

    def _write(self, out: Any, job: Job, slot: Slot) -> None:
        windows = [np.asarray(out[i]) for i in range(len(out))]
        self._resizer.resize(windows, job.image_size, job.crops.flips, self._antialias, out=slot.array)


class DaliGpuDecoder(_DaliDecoder):
    """nvJPEG ROI decode, DALI's resize and flip on the stream's GPU."""

    gpu = True

    def __init__(self, spec: PipelineSpec) -> None:
        super().__init__(spec)
        self.device_copies = self.host_copies = 0

    def _write(self, out: Any, job: Job, slot: Slot) -> None:
        if slot.tensor.device.type == "cuda":
            _copy_on_device(out, slot.tensor)
            self.device_copies += 1
        else:
            np.copyto(slot.array, out.as_cpu().as_array())
            self.host_copies += 1


def _copy_on_device(out: Any, dst: Any) -> None:
    """DALI's GPU output (a TensorListGPU of equal-shaped samples) into ``dst``, a
    contiguous uint8 CUDA tensor, device to device, on ``dst``'s device's current
    stream (the CUDA IPC sender records the slot's event there).

    ``outputs()`` returned the run finished (synchronised with the host). The copy
    waits for its own end: DALI takes the source buffer back at the next
    ``outputs()`` and may reuse it on its own streams, which are not ordered after
    ours; a batch's copy takes tens of microseconds, its decoding milliseconds."""
    import torch

    shapes = [list(s) for s in out.shape()]
    if not dst.is_contiguous() or shapes != [list(dst.shape[1:])] * int(dst.shape[0]):
        raise FeederError(f"device output of {len(shapes)} samples does not fit {list(dst.shape)}")
    with torch.cuda.device(dst.device):
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        out.copy_to_external(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(stream), non_blocking=False)
