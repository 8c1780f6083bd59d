"""Resize decoded crop windows to one square size and mirror the flipped ones, on the
CPU, into one preallocated batch array, with a small thread pool.

Measured on 2 cores (sample data, crops averaging 254x255 px to 224 px), per image on
one core: OpenCV ``INTER_LINEAR`` 0.12 ms, torch's uint8 antialiased bilinear 0.21 ms,
OpenCV ``INTER_AREA`` 0.38 ms; DALI's own CPU resize about 1.2 ms. Each filter is the
fastest that passes the pixel check against its reference (tests/feeder/test_resize.py):

- ``antialias=False``: OpenCV ``INTER_LINEAR`` (half-pixel centres, 11-bit fixed
  point weights): within 1 level of an exact float bilinear resize (tf.data's
  ``resize(bilinear)``, torch ``interpolate(antialias=False)``).
- ``antialias=True``: torch's uint8 ``interpolate(mode="bilinear", antialias=True)``
  (a triangle filter widened by the downscale factor): within 1 level of Pillow's
  ``BILINEAR`` resize, which torchvision's RandomResizedCrop applies to PIL images.
  ``INTER_AREA`` (a box filter) misses it by up to 11 levels.

Both libraries release the GIL while they work, so the pool's threads run in parallel;
each thread takes a contiguous slice of the batch (a few Python calls per image).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np

__all__ = ["BatchResizer"]


def _resize_linear(src: np.ndarray, dst: np.ndarray) -> None:
    cv2.resize(src, (dst.shape[1], dst.shape[0]), dst=dst, interpolation=cv2.INTER_LINEAR)


def _resize_antialiased(src: np.ndarray, dst: np.ndarray) -> None:
    import torch  # only this filter needs it; the daemon imports torch lazily

    image = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1).unsqueeze(0)
    out = torch.nn.functional.interpolate(image, size=dst.shape[:2], mode="bilinear", antialias=True)
    torch.from_numpy(dst).copy_(out[0].permute(1, 2, 0))


class BatchResizer:
    """Resizes uint8 HWC images into ``[N, size, size, 3]`` and mirrors flagged ones.

    Args:
        threads: worker threads (the CPUs this stage may use).
    """

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="feeder-resize")
        cv2.setNumThreads(1)  # parallel over images in our pool, not inside one image

    def resize(
        self, images: Sequence[np.ndarray], size: int, flips: np.ndarray, antialias: bool = False,
        out: np.ndarray | None = None,
    ) -> np.ndarray:
        """Resize each image to ``size x size`` (bilinear), mirror where ``flips``.

        Args:
            images: uint8 ``[h, w, 3]`` arrays (any sizes).
            size: output side in pixels.
            flips: bool ``[N]``.
            antialias: widen the filter when downscaling (see module doc).
            out: uint8 ``[N, size, size, 3]`` to write into (None: a new array).

        Returns:
            ``out``, filled.
        """
        if out is None:
            out = np.empty((len(images), size, size, 3), dtype=np.uint8)
        one = _resize_antialiased if antialias else _resize_linear

        def work(rows: range) -> None:
            for i in rows:
                one(images[i], out[i])
                if flips[i]:
                    cv2.flip(out[i], 1, dst=out[i])

        bounds = np.linspace(0, len(images), self.threads + 1).astype(int)
        chunks = [range(a, b) for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        futures = [self._pool.submit(work, c) for c in chunks[1:]]
        if chunks:
            work(chunks[0])  # this thread takes the first slice itself
        for future in futures:
            future.result()
        return out

    def close(self) -> None:
        """Stop the worker threads."""
        self._pool.shutdown(wait=False)
