"""The CPU window decoder: only each crop window is decoded by :mod:`shards.jpeg`
(libjpeg-turbo; rows and columns cropped before the IDCT and, on the sharder's JPEGs
with restart markers, before the entropy decoding too; at a reduced DCT scale where
the window is at least twice the output), then the CPU finishing stage
(:class:`decode.finish.Finisher`: the GIL-free C resize of ``decode/_resize.c``,
mirroring as it resizes; OpenCV's, image by image, where that library was not built)
finishes the batch on the workers. Per window on one core: 0.25 ms (0.32 without
restart markers) where DALI's ``decoders.image_slice`` takes 0.43. Into a device slot
it writes through pinned staging memory and an upload on the slot's stream (the CPU
part of a split GPU pipeline, :mod:`decode.split_decoder`). Slow samples are decoded
ahead of their batches (:mod:`decode.look_ahead`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.workers import Lane
from decode.decoder import PhasedDecoder, batch_shape
from decode.finish import Finisher
from decode.jobs import Job, SampleDecodeError
from decode.look_ahead import LookAhead
from decode.pipeline import PipelineSpec
from shards import jpeg
from transport.base import Slot

__all__ = ["TurboDecoder"]


class TurboDecoder(PhasedDecoder):
    """The libjpeg-turbo window decoder and the finishing stage, both on ``lane``."""

    can_look_ahead = True

    @classmethod
    def unavailable_reason(cls) -> str | None:
        return jpeg.unavailable_reason()

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
        return batch_shape(collected[0])

    def write(self, collected: _Collected, slot: Slot) -> None:
        job, decoding, windows = collected
        try:
            if not slot.on_gpu:
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
        pixels = staging.numpy().reshape(slot.shape)
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
