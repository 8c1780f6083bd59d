"""The decoded cache, the daemon's second cache level (the page cache over the mapped
shards is the first): decoded images kept in RAM, downscaled so that their shorter
side is at most ``side`` pixels (FFCV's max-resolution idea), shared by every stream
and every job of the daemon.

- **Admit until full, never evict.** Training reads every sample once per epoch in a
  uniformly random order; LRU would only churn (each entry evicted before its next
  use). The first ``budget_bytes`` worth of images stay; once an image does not fit,
  admission stops for good and later misses decode from JPEG.
- **Budget, not hope.** Each entry costs its pixels plus a fixed overhead
  (``ENTRY_OVERHEAD_BYTES``); the sum never exceeds the budget. A budget larger than
  the machine's memory is refused at start with both numbers.
- **Filling.** A sample is decoded whole (it serves any later crop), at the largest
  libjpeg-turbo DCT scale (1/2, 1/4, 1/8) that keeps its shorter side >= ``side``,
  then downscaled with OpenCV ``INTER_LINEAR``: after the DCT scaling the remaining
  factor is below 2, so the bilinear taps still cover every source pixel. Measured
  on 2 cores (sample data, ~400 px images to a 256 px side, per image on one core):
  ``INTER_AREA`` 1.46 ms, ``INTER_LINEAR`` 0.14 ms, mean difference between the two
  0.65 levels; the decode itself 0.47 ms. ``INTER_AREA`` would roughly double the
  first epoch's cost for no visible change.
- **Crops keep their law.** Windows are drawn in the original image's pixels (from
  the index's width and height, :mod:`decode.augment`) and mapped into the cached
  image by :func:`cached_windows`, so the distribution of crops is unchanged; only the
  pixels inside a window are the downscaled ones.
"""

from __future__ import annotations

import threading
from collections.abc import Hashable
from dataclasses import dataclass
from typing import Protocol

import cv2
import numpy as np

from core.errors import ConfigError

__all__ = [
    "ENTRY_OVERHEAD_BYTES",
    "CacheCounters",
    "CacheUsage",
    "DecodedCache",
    "SampleSizes",
    "cached_windows",
    "check_budget",
    "decode_downscaled",
]

# Bookkeeping per entry besides its pixels: the ndarray header (~112 bytes) and its
# dict slot and key tuple (~100 bytes), rounded up.
ENTRY_OVERHEAD_BYTES = 256
_MAX_DCT_SHIFT = 3  # libjpeg-turbo's scaled IDCT goes down to 1/8
# cv2.IMREAD_REDUCED_GRAYSCALE_{2,4,8} are the scale bits; RGB order is asked for
# separately (the REDUCED_COLOR constants mean BGR).
_DCT_SCALE_FLAGS = (0, cv2.IMREAD_REDUCED_GRAYSCALE_2, cv2.IMREAD_REDUCED_GRAYSCALE_4, cv2.IMREAD_REDUCED_GRAYSCALE_8)
# Windows are drawn in the stored pixel grid (the index's width/height), as the DALI
# decoder reads it (adjust_orientation=False): an EXIF rotation would move them.
_DECODE_FLAGS = cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION


def check_budget(budget_bytes: int, memory_bytes: int) -> None:
    """Refuse a cache budget the machine cannot hold.

    Args:
        budget_bytes: the cache's budget.
        memory_bytes: the machine's or its container's memory (the daemon's
            :func:`feeder.config_values.physical_memory_bytes`).

    Raises:
        ConfigError: ``budget_bytes`` exceeds ``memory_bytes``, naming both.
    """
    if budget_bytes > memory_bytes:
        raise ConfigError(
            f"decoded_cache_bytes: {budget_bytes} bytes ({budget_bytes / 2**30:.1f} GiB) exceed this "
            f"machine's memory, {memory_bytes} bytes ({memory_bytes / 2**30:.1f} GiB)"
        )


def decode_downscaled(jpeg: np.ndarray, side: int, shorter_px: int) -> np.ndarray | None:
    """Decode a whole JPEG to RGB with its shorter side at most ``side`` (see module
    doc for the filter).

    Args:
        jpeg: encoded bytes.
        side: largest shorter side kept, pixels.
        shorter_px: the image's shorter side as stored (from the index), which picks
            the DCT scale before anything is decoded.

    Returns:
        uint8 ``[h, w, 3]``, or None when the bytes do not decode.
    """
    shift = 0
    while shift < _MAX_DCT_SHIFT and -(-shorter_px // (2 << shift)) >= side:
        shift += 1
    image = cv2.imdecode(jpeg, _DECODE_FLAGS | _DCT_SCALE_FLAGS[shift])
    if image is None or image.ndim != 3 or image.shape[2] != 3:
        return None
    height, width = image.shape[:2]
    shorter = min(height, width)
    if shorter <= side:
        return image
    scale = side / shorter
    size = (max(1, round(width * scale)), max(1, round(height * scale)))
    return cv2.resize(image, size, interpolation=cv2.INTER_LINEAR)


def cached_windows(
    boxes: np.ndarray, widths: np.ndarray, heights: np.ndarray, shapes: np.ndarray
) -> np.ndarray:
    """Crop windows in original pixels mapped into the cached images.

    Args:
        boxes: int ``[N, 4]`` x, y, width, height in the original image's pixels.
        widths, heights: the original images' sizes ``[N]``.
        shapes: int ``[N, 2]`` height, width of the cached images.

    Returns:
        int ``[N, 4]`` x0, y0, x1, y1 in cached pixels (edges rounded to the nearest
        cached pixel, at least one pixel wide, inside the image).
    """
    boxes = np.asarray(boxes, dtype=np.float64)
    sx = shapes[:, 1] / np.asarray(widths, dtype=np.float64)
    sy = shapes[:, 0] / np.asarray(heights, dtype=np.float64)
    x0 = np.clip(np.rint(boxes[:, 0] * sx), 0, shapes[:, 1] - 1)
    y0 = np.clip(np.rint(boxes[:, 1] * sy), 0, shapes[:, 0] - 1)
    x1 = np.clip(np.rint((boxes[:, 0] + boxes[:, 2]) * sx), x0 + 1, shapes[:, 1])
    y1 = np.clip(np.rint((boxes[:, 1] + boxes[:, 3]) * sy), y0 + 1, shapes[:, 0])
    return np.stack([x0, y0, x1, y1], axis=1).astype(np.int64)


@dataclass(frozen=True)
class CacheUsage:
    """What the cache holds now."""

    entries: int
    used_bytes: int
    budget_bytes: int
    admitting: bool


class CacheCounters(Protocol):
    """Where a batch's lookups are counted (the daemon's metrics)."""

    def decoded_cache(self, usage: CacheUsage, hits: int = 0, misses: int = 0, bypassed: int = 0) -> None: ...


class SampleSizes(Protocol):
    """The original sizes of a split's samples, by index (from its index), in which
    crop windows are drawn."""

    @property
    def widths(self) -> np.ndarray: ...

    @property
    def heights(self) -> np.ndarray: ...


class DecodedCache:
    """Decoded images by key, within a byte budget; admit until full, no eviction.

    Thread-safe: lookups are plain dict reads; admissions take a lock.

    Args:
        budget_bytes: most bytes held (pixels plus ``ENTRY_OVERHEAD_BYTES`` each).
        side: cached images' shorter side is at most this many pixels.

    Raises:
        ConfigError: ``budget_bytes`` < 1 or ``side`` < 1.
    """

    def __init__(self, budget_bytes: int, side: int) -> None:
        if budget_bytes < 1 or side < 1:
            raise ConfigError(f"decoded cache: budget {budget_bytes} bytes and side {side} px must be >= 1")
        self.budget_bytes = budget_bytes
        self.side = side
        self._images: dict[Hashable, np.ndarray] = {}
        self._used = 0
        self._admitting = True
        self._lock = threading.Lock()

    def get(self, key: Hashable) -> np.ndarray | None:
        """The cached image for ``key`` (read-only uint8 HWC), or None."""
        return self._images.get(key)

    @property
    def admitting(self) -> bool:
        """False once an image did not fit: from then on nothing is admitted."""
        return self._admitting

    def admit(self, key: Hashable, image: np.ndarray) -> bool:
        """Keep ``image`` under ``key`` if the budget allows; returns whether it is
        held (True also when ``key`` was already there)."""
        cost = image.nbytes + ENTRY_OVERHEAD_BYTES
        with self._lock:
            if key in self._images:
                return True
            if not self._admitting or self._used + cost > self.budget_bytes:
                self._admitting = False
                return False
            image.flags.writeable = False  # shared by every stream: nobody may change it
            self._images[key] = image
            self._used += cost
            return True

    def usage(self) -> CacheUsage:
        """Entries, bytes and whether it still admits."""
        with self._lock:
            return CacheUsage(len(self._images), self._used, self.budget_bytes, self._admitting)
