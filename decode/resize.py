"""Resize decoded crop windows to one square size and mirror the flipped ones, on the
CPU, into one preallocated batch array, with a small thread pool.

Measured on 2 cores (sample data, crops averaging 254x255 px to 224 px), per image on
one core: OpenCV ``INTER_LINEAR`` 0.12 ms, torch's uint8 antialiased bilinear 0.21 ms,
OpenCV ``INTER_AREA`` 0.38 ms; DALI's own CPU resize about 1.2 ms. Each filter is the
fastest that passes the pixel check against its reference (tests/decode/test_resize.py):

- ``antialias=False``: OpenCV ``INTER_LINEAR`` (half-pixel centres, 11-bit fixed
  point weights): within 1 level of an exact float bilinear resize (tf.data's
  ``resize(bilinear)``, torch ``interpolate(antialias=False)``).
- ``antialias=True``: torch's uint8 ``interpolate(mode="bilinear", antialias=True)``
  (a triangle filter widened by the downscale factor): within 1 level of Pillow's
  ``BILINEAR`` resize, which torchvision's RandomResizedCrop applies to PIL images.
  ``INTER_AREA`` (a box filter) misses it by up to 11 levels.

Both libraries release the GIL while they work, so the workers run in parallel, but
each call takes it back when it returns: with two workers and the stream's own thread
taking turns, a worker spent about a third of its time in OpenCV's resize waiting for
it (docs/performance.md, Decoded cache). So the plain filter runs, where it was built,
in ``decode/_resize.c``: the same filter (within 1 level of the exact one, and of
OpenCV's), with the mirroring done by the resize itself (its column table reversed): a
batch is one call on each worker, the GIL released throughout, the calls taking the
next image from a shared counter until none is left. Each call is one item of the
stream's lane on the daemon's shared workers (:mod:`core.workers`); a worker busy with
another lane's item joins late or finds nothing left. Without the library (no C
compiler at install, a CPU without SSSE3) each image is one item, resized by OpenCV.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import cv2
import numpy as np

from core.native import load_library
from core.workers import Lane, Loop

__all__ = ["BatchResizer", "NativeBatch", "native_unavailable_reason"]

# Images per call of the C resize at least: below that a worker's call costs more in
# taking the GIL back than it shares (8 at 224 px are about 0.4 ms of work).
_MIN_PER_CALL = 8
# struct feeder_resize_item in _resize.c.
_ITEM = np.dtype([
    ("src", np.uintp), ("src_stride", np.int64), ("width", np.int32), ("height", np.int32),
    ("dst", np.uintp), ("dst_width", np.int32), ("dst_height", np.int32), ("flip", np.int32),
    ("pad", np.int32),
])


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    lib.feeder_resize_linear.restype = ctypes.c_int
    lib.feeder_resize_linear.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                                         ctypes.c_int]
    lib.feeder_resize_simd.restype = ctypes.c_int
    lib.feeder_resize_simd.argtypes = []
    return lib


@cache
def _library() -> ctypes.CDLL | str:
    """The C resize where it is built and this CPU has its SIMD path, or why not (its
    portable path is kept for the tests: slower than OpenCV)."""
    lib = load_library(Path(__file__).resolve().parent, "_resize", _declare)
    if isinstance(lib, str):
        return lib
    return lib if lib.feeder_resize_simd() else "this CPU has no SSSE3, which decode/_resize.c's fast path needs"


def native_unavailable_reason() -> str | None:
    """Why the plain filter is OpenCV's, one image per call (None: it is the C one)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def _items(images: Sequence[np.ndarray], out: np.ndarray, flips: np.ndarray) -> np.ndarray | None:
    """The C resize's list for ``images`` into ``out``, or None where an image is not
    RGB bytes with its pixels packed (then OpenCV resizes them)."""
    items = np.zeros(len(images), _ITEM)
    src, stride, width, height = items["src"], items["src_stride"], items["width"], items["height"]
    for i, image in enumerate(images):
        if image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3 or image.strides[1:] != (3, 1):
            return None
        src[i] = image.__array_interface__["data"][0]
        stride[i], height[i], width[i] = image.strides[0], image.shape[0], image.shape[1]
    n, size = out.shape[0], out.shape[1]
    items["dst"] = out.__array_interface__["data"][0] + np.arange(n, dtype=np.uintp) * (size * size * 3)
    items["dst_width"] = items["dst_height"] = size
    items["flip"] = np.asarray(flips, dtype=bool)[:n]
    return items


class NativeBatch:
    """A batch's list for the C resize (``_ITEM`` records) and the counters its calls
    share: the next image to claim and the first that failed."""

    def __init__(self, items: np.ndarray) -> None:
        self.items = items
        self.counters = np.array([0, -1], dtype=np.intc)
        self._addresses = (items.__array_interface__["data"][0], self.counters.__array_interface__["data"][0])

    def resize(self, simd: bool = True) -> int:
        """Resize images claimed from the batch until none is left, in one call of the
        C library, the GIL released (``simd=False``: its portable path); how many this
        call resized.

        Raises:
            ValueError: an image or the output is empty (one such is named).
        """
        lib = _library()
        if isinstance(lib, str):
            raise RuntimeError(lib)
        items, counters = self._addresses
        done = lib.feeder_resize_linear(items, len(self.items), counters, counters + ctypes.sizeof(ctypes.c_int),
                                        int(simd))
        failed = int(self.counters[1])
        if failed >= 0:
            bad = self.items[failed]
            raise ValueError(f"cannot resize image {failed} of the batch: {bad['width']}x{bad['height']} "
                             f"to {bad['dst_width']}x{bad['dst_height']}")
        return int(done)


def _resize_linear(src: np.ndarray, dst: np.ndarray) -> None:
    cv2.resize(src, (dst.shape[1], dst.shape[0]), dst=dst, interpolation=cv2.INTER_LINEAR)


def _resize_antialiased(src: np.ndarray, dst: np.ndarray) -> None:
    import torch

    image = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1).unsqueeze(0)
    out = torch.nn.functional.interpolate(image, size=dst.shape[:2], mode="bilinear", antialias=True)
    torch.from_numpy(dst).copy_(out[0].permute(1, 2, 0))


class BatchResizer:
    """Resizes uint8 HWC images into ``[N, size, size, 3]`` and mirrors flagged ones.

    Args:
        lane: where the work runs (the stream's lane on the daemon's workers).
    """

    def __init__(self, lane: Lane) -> None:
        self._lane = lane
        cv2.setNumThreads(1)  # parallel over images on the workers, not inside one image

    def resize(
        self, images: Sequence[np.ndarray], size: int, flips: np.ndarray, antialias: bool = False,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """:meth:`start` and wait for it: ``out``, filled."""
        out, loop = self.start(images, size, flips, antialias, out, first=True)
        loop.wait()
        return out

    def start(
        self, images: Sequence[np.ndarray], size: int, flips: np.ndarray, antialias: bool = False,
        out: np.ndarray | None = None, first: bool = False,
    ) -> tuple[np.ndarray, Loop]:
        """Start resizing each image to ``size x size`` (bilinear) and mirroring where
        ``flips``, on the lane; ``out`` and the loop to wait on before reading it.

        Args:
            images: uint8 ``[h, w, 3]`` arrays (any sizes).
            size: output side in pixels.
            flips: bool ``[N]``.
            antialias: widen the filter when downscaling (see module doc).
            out: uint8 ``[N, size, size, 3]`` to write into (None: a new array).

            first: ahead of the lane's loops not yet started (its caller waits on it).

        Returns:
            ``out`` (filled once the loop has ended) and the loop.
        """
        if out is None:
            out = np.empty((len(images), size, size, 3), dtype=np.uint8)
        items = None
        if not antialias and native_unavailable_reason() is None and out.flags.c_contiguous:
            items = _items(images, out, flips)
        if items is not None:
            batch = NativeBatch(items)
            calls = max(1, min(self._lane.threads, len(items) // _MIN_PER_CALL))

            def call(_: int, held: Sequence[np.ndarray] = images) -> None:  # held: read by address
                batch.resize()

            return out, self._lane.parallel(call, calls if len(items) else 0, first=first)
        one = _resize_antialiased if antialias else _resize_linear

        def work(i: int) -> None:
            one(images[i], out[i])
            if flips[i]:
                cv2.flip(out[i], 1, dst=out[i])

        return out, self._lane.parallel(work, len(images), first=first)
