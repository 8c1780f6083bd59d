"""DALI's decoders: its CPU ROI decode (:class:`DaliCpuDecoder`, where the window
decoder was not built, or asked for), then the CPU finishing stage (DALI's CPU resize
costs ~1.2 ms per image); and its ``mixed`` ROI decode (:class:`DaliGpuDecoder`:
nvJPEG, ``hw_decoder_load`` of it on the hardware JPEG engines) on the stream's device,
then the finishing stage in its DALI graph there (:func:`decode.finish.finish_graph`).
A GPU batch whose slot is on a GPU (a CUDA IPC slot) is copied device to device on the
slot's stream, never through host memory, and nothing waits on the host.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.workers import Lane
from decode import finish
from decode.decoder import PhasedDecoder, batch_shape
from decode.finish import Finisher
from decode.jobs import Job
from decode.pipeline import ANCHORS, JPEGS, SHAPES, PipelineSpec, dali_decode_error
from transport.base import Slot

__all__ = ["DaliCpuDecoder", "DaliGpuDecoder", "feed"]


def feed(pipe: Any, job: Job, finishing: bool, photometric: bool = False) -> None:
    """Feeds a run of a pipeline of :mod:`decode.pipeline`: the job's JPEGs and
    windows and, where its graph finishes the batch (``finishing``), what
    :func:`decode.finish.feed` feeds."""
    boxes = job.crops.boxes.astype(np.float32)
    pipe.feed_input(JPEGS, list(job.jpegs))
    pipe.feed_input(ANCHORS, list(boxes[:, :2]))
    pipe.feed_input(SHAPES, list(boxes[:, 2:]))
    if finishing:
        finish.feed(pipe, job.image_size, job.crops, photometric)


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
    """What both DALI decoders share: feeding a run, collecting it in order. A DALI
    run decodes its batch as one (nothing is decoded ahead), on DALI's threads."""

    own_threads = True

    def __init__(self, spec: PipelineSpec, lane: Lane | None = None) -> None:
        from decode.dali_graphs import build_dali  # DALI loads with the first DALI decoder built

        self._pipe = build_dali(spec)
        self._photometric = spec.photometric and self.device == "gpu"

    def start(self, job: Job) -> Job:
        feed(self._pipe, job, finishing=self.device == "gpu", photometric=self._photometric)
        self._pipe.schedule_run()
        return job

    def collect(self, job: Job) -> tuple[Job, Any]:
        return job, _outputs(self._pipe, job)

    def shape(self, collected: tuple[Job, Any]) -> tuple[int, int, int, int]:
        return batch_shape(collected[0])

    def write(self, collected: tuple[Job, Any], slot: Slot) -> None:
        raise NotImplementedError

    def release_buffers(self) -> None:
        pass  # DALI keeps its peak buffers while the pipeline lives

    def close(self) -> None:
        _shutdown(self._pipe)


class DaliCpuDecoder(_DaliDecoder):
    """DALI's CPU ROI decode (on DALI's ``spec.threads`` threads) and the finishing
    stage (on ``lane``)."""

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        super().__init__(spec, lane)
        self._finisher = Finisher(lane, spec.antialias)

    def write(self, collected: tuple[Job, Any], slot: Slot) -> None:
        job, out = collected
        windows = [np.asarray(out[i]) for i in range(len(out))]
        self._finisher.finish(windows, job.image_size, job.crops, out=slot.array)


class DaliGpuDecoder(_DaliDecoder):
    """nvJPEG ROI decode and the finishing stage on the stream's GPU. Its outputs are
    bound to a stream of its own; a device slot is written on the slot's stream after
    it, and the output is kept until that copy is done (:class:`Held`): no host wait."""

    device = "gpu"

    def __init__(self, spec: PipelineSpec, lane: Lane | None = None) -> None:  # its work is DALI's, on the GPU
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
        if not slot.on_gpu:
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
