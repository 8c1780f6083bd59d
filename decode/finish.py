"""The finishing stage: a batch's decoded windows become its output pixels, each
resized to the run's side, mirrored where its flip says and toned where its
photometric factors say, whichever path decoded it.

What a sample's finish does is drawn in one place (:func:`decode.augment.sample_crops`,
from seed, epoch and sample key) and travels with its job
(:class:`decode.augment.Crops`); here it is applied, in one of two ways:

- on the CPU, :class:`Finisher`: the batch resize (:class:`decode.resize.BatchResizer`,
  the C one mirroring as it resizes) on the stream's lane, then the photometric steps
  image by image on the lane (a 256-entry table per image, OpenCV's LUT, the GIL
  released). The window decoder's batches, DALI's CPU decoder's, the split decoder's
  CPU rows and the decoded cache's hits all end here.
- in a DALI graph, :func:`finish_graph`: DALI's resize and flip, then its
  ``brightness_contrast`` where the pipeline has the photometric steps, on the device
  of its input (the GPU, after a ``mixed`` decode), fed per run by :func:`feed`.

Both tone a value ``x`` into ``brightness * (128 + contrast * (x - 128))``, computed
in float32 and rounded to the nearest level, and DALI's bilinear resize and the C one agree within one grey
level (``tests/decode/test_finish.py``), so a sample's pixels do not depend on the
path its batch took beyond that.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol

import cv2
import numpy as np

from core.workers import Lane
from decode.augment import Crops, Tone
from decode.resize import BatchResizer

__all__ = ["BRIGHTNESS", "CONTRAST", "FLIPS", "MID_GREY", "SIZES", "Finisher", "Finishing", "feed", "finish_graph",
           "tone_table"]

# Names of the finishing graph's external sources.
SIZES, FLIPS, BRIGHTNESS, CONTRAST = "sizes", "flips", "brightness", "contrast"
MID_GREY = np.float32(128)  # the level contrast scales about (DALI's contrast_center)


class Finishing(Protocol):
    """A batch being finished: :meth:`wait` returns once its pixels are all written."""

    def wait(self) -> None: ...


def tone_table(tone: Tone, row: int) -> np.ndarray:
    """Sample ``row``'s photometric steps as a table of its 256 levels (uint8)."""
    levels = np.arange(256, dtype=np.float32)
    values = tone.brightness[row] * (MID_GREY + tone.contrast[row] * (levels - MID_GREY))  # float32, as DALI's
    return np.clip(np.rint(values), 0, 255).astype(np.uint8)


class _Toned:
    """The resize under way, then each image's photometric steps on the lane."""

    def __init__(self, resizing: Finishing, lane: Lane, out: np.ndarray, tone: Tone) -> None:
        self._resizing, self._lane, self._out, self._tone = resizing, lane, out, tone
        self._done = False

    def wait(self) -> None:
        self._resizing.wait()
        if self._done:
            return
        self._done = True
        out, tone = self._out, self._tone

        def one(i: int) -> None:
            cv2.LUT(out[i], tone_table(tone, i), dst=out[i])

        self._lane.run(one, len(out))


class Finisher:
    """The CPU finishing stage of one pipeline.

    Args:
        lane: where its work runs (the stream's lane on the daemon's workers).
        antialias: the resize filter (see :mod:`decode.resize`).
    """

    def __init__(self, lane: Lane, antialias: bool = False) -> None:
        self._lane = lane
        self._resizer = BatchResizer(lane)
        self.antialias = antialias

    def finish(self, windows: Sequence[np.ndarray], size: int, crops: Crops, out: np.ndarray | None = None
               ) -> np.ndarray:
        """:meth:`start`, and wait for it: ``out``, written."""
        out, finishing = self.start(windows, size, crops, out, first=True)
        finishing.wait()
        return out

    def start(self, windows: Sequence[np.ndarray], size: int, crops: Crops, out: np.ndarray | None = None,
              first: bool = False) -> tuple[np.ndarray, Finishing]:
        """Start finishing each window into ``out`` on the lane.

        Args:
            windows: the decoded windows, uint8 ``[h, w, 3]`` of any sizes.
            size: the output side in pixels.
            crops: the windows' flips and photometric factors (one row per window).
            out: uint8 ``[N, size, size, 3]`` to write into (None: a new array).
            first: ahead of the lane's work not yet started (its caller waits on it).

        Returns:
            ``out`` (written once the finishing's :meth:`~Finishing.wait` returns) and
            the finishing.
        """
        out, resizing = self._resizer.start(windows, size, crops.flips, self.antialias, out, first=first)
        if crops.tone is None:
            return out, resizing
        return out, _Toned(resizing, self._lane, out, crops.tone)


def finish_graph(images: Any, antialias: bool, photometric: bool = False) -> Any:
    """The finishing stage in a DALI graph, on ``images``' device: each image resized to
    its run's side (``sizes``, float32 ``[side]`` per sample), mirrored where its
    ``flips`` (int32 scalar, 1 = mirror) says and, with ``photometric``, toned by its
    factors (float32 scalars). Fed by :func:`feed`."""
    from nvidia.dali import fn, types  # DALI loads with the graphs (decode.dali_graphs)

    sizes = fn.external_source(name=SIZES, dtype=types.DALIDataType.FLOAT, ndim=1)
    flips = fn.external_source(name=FLIPS, dtype=types.DALIDataType.INT32, ndim=0)
    side = sizes[0]
    resized = fn.resize(images, resize_x=side, resize_y=side, antialias=antialias)
    finished = fn.flip(resized, horizontal=flips, vertical=0)  # type: ignore[arg-type]
    if not photometric:
        return finished
    brightness = fn.external_source(name=BRIGHTNESS, dtype=types.DALIDataType.FLOAT, ndim=0)
    contrast = fn.external_source(name=CONTRAST, dtype=types.DALIDataType.FLOAT, ndim=0)
    return fn.brightness_contrast(finished, brightness=brightness, contrast=contrast, contrast_center=float(MID_GREY))


def feed(pipe: Any, size: int, crops: Crops, photometric: bool = False) -> None:
    """Feeds a run of :func:`finish_graph`: its side, each sample's flip and, with
    ``photometric``, its factors (those that change nothing where it drew none)."""
    pipe.feed_input(SIZES, [np.array([size], dtype=np.float32)] * len(crops))
    pipe.feed_input(FLIPS, list(crops.flips.astype(np.int32)))
    if photometric:
        tone = crops.tone if crops.tone is not None else Tone.unchanged(len(crops))
        pipe.feed_input(BRIGHTNESS, list(tone.brightness))
        pipe.feed_input(CONTRAST, list(tone.contrast))
