"""Crop windows and flips as a pure function of (seed, epoch, sample key).

A sample's RandomResizedCrop box and flip bit are drawn from a counter-based generator
(Philox-4x32-10, Salmon et al. 2011, the generator of cuRAND and JAX): the key is a
hash of (seed, epoch), the counter holds a 64-bit hash of the sample key and the draw
index. No state is carried from one sample to the next, so batch size, world size,
the order samples arrive in, a resume or a daemon restart cannot change a sample's
augmentation. Everything is vectorised over a batch.

The crop follows torchvision's ``RandomResizedCrop.get_params``: area fraction
uniform in ``[min_scale, max_scale]``, aspect ratio log-uniform in
``[min_ratio, max_ratio]``, side lengths rounded half to even, up to 10 tries, then
the central crop with the ratio clamped to the range. Boxes are integer
``(x, y, width, height)`` in the original image's pixel coordinates.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from protocol.request import AugmentKind, CropRange

__all__ = [
    "VAL_CROP_FRACTION",
    "Crops",
    "centre_crops",
    "key_hashes",
    "philox4x32",
    "random_resized_crops",
    "sample_crops",
]

# Validation resizes the shorter side to image_size / VAL_CROP_FRACTION, then takes
# the centre image_size square (the 224 / 256 convention). In original coordinates:
# the centre square of side VAL_CROP_FRACTION * shorter side.
VAL_CROP_FRACTION = 0.875
TRIES = 10  # torchvision's attempts before the central fallback

_M0, _M1 = np.uint64(0xD2511F53), np.uint64(0xCD9E8D57)
_W0, _W1 = np.uint32(0x9E3779B9), np.uint32(0xBB67AE85)
_LOW32 = np.uint64(0xFFFFFFFF)
_ROUNDS = 10
# Draws per sample, as Philox blocks of four 32-bit words: TRIES (area, ratio) pairs,
# then one block with the x offset, the y offset and the flip.
_BLOCKS = TRIES // 2 + 1


@dataclass(frozen=True)
class Crops:
    """Per-sample crop windows and flips of one batch.

    Attributes:
        boxes: int32 ``[N, 4]``: x, y, width, height in original pixels.
        flips: bool ``[N]``: mirror horizontally after the resize.
    """

    boxes: np.ndarray
    flips: np.ndarray

    def __len__(self) -> int:
        return len(self.boxes)

    def rows(self, positions: Sequence[int] | np.ndarray) -> Crops:
        """The crops of the samples at ``positions`` alone, in that order."""
        rows = np.asarray(positions, dtype=np.intp)
        return Crops(boxes=self.boxes[rows], flips=self.flips[rows])


def key_hashes(keys: Sequence[str]) -> np.ndarray:
    """Stable 64-bit hashes of sample keys (blake2b), as uint64."""
    digests = b"".join(hashlib.blake2b(k.encode(), digest_size=8).digest() for k in keys)
    return np.frombuffer(digests, dtype="<u8").astype(np.uint64)


def _mulhilo(a: np.ndarray, m: np.uint64) -> tuple[np.ndarray, np.ndarray]:
    product = a.astype(np.uint64) * m
    return (product >> np.uint64(32)).astype(np.uint32), (product & _LOW32).astype(np.uint32)


def philox4x32(counters: np.ndarray, key: tuple[int, int]) -> np.ndarray:
    """Philox-4x32-10 of each row of ``counters`` (uint32 ``[N, 4]``) under ``key``
    (two 32-bit words). Returns uint32 ``[N, 4]``."""
    c0, c1, c2, c3 = (counters[:, i].astype(np.uint32) for i in range(4))
    k0, k1 = np.uint32(key[0]), np.uint32(key[1])
    with np.errstate(over="ignore"):
        for _ in range(_ROUNDS):
            hi0, lo0 = _mulhilo(c0, _M0)
            hi1, lo1 = _mulhilo(c2, _M1)
            c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
            k0, k1 = k0 + _W0, k1 + _W1
    return np.stack([c0, c1, c2, c3], axis=1)


def _stream_key(seed: int, epoch: int) -> tuple[int, int]:
    data = seed.to_bytes(16, "little", signed=True) + epoch.to_bytes(16, "little", signed=True)
    word = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")
    return word & 0xFFFFFFFF, word >> 32


def _uniforms(seed: int, epoch: int, hashes: np.ndarray) -> np.ndarray:
    """float64 ``[N, 4 * _BLOCKS]`` in [0, 1): the draws of each sample."""
    n = len(hashes)
    counters = np.zeros((n, _BLOCKS, 4), dtype=np.uint32)
    counters[:, :, 0] = np.arange(_BLOCKS, dtype=np.uint32)
    counters[:, :, 2] = (hashes & _LOW32).astype(np.uint32)[:, None]
    counters[:, :, 3] = (hashes >> np.uint64(32)).astype(np.uint32)[:, None]
    words = philox4x32(counters.reshape(-1, 4), _stream_key(seed, epoch))
    return words.reshape(n, 4 * _BLOCKS) * (1.0 / 2**32)


def _fallback(widths: np.ndarray, heights: np.ndarray, crop: CropRange) -> tuple[np.ndarray, np.ndarray]:
    ratio = widths / heights
    narrowed = np.where(ratio > crop.max_ratio, np.rint(heights * crop.max_ratio), widths)
    w = np.where(ratio < crop.min_ratio, widths, narrowed)
    h = np.where(ratio < crop.min_ratio, np.rint(widths / crop.min_ratio), heights)
    return w.astype(np.int64), h.astype(np.int64)


def random_resized_crops(
    seed: int, epoch: int, hashes: np.ndarray, widths: np.ndarray, heights: np.ndarray, crop: CropRange
) -> Crops:
    """RandomResizedCrop boxes and flips (torchvision semantics, see module doc).

    Args:
        seed: the job's seed.
        epoch: the epoch (a different epoch draws different crops).
        hashes: :func:`key_hashes` of the samples' keys, uint64 ``[N]``.
        widths, heights: the original images' sizes in pixels, ``[N]``.
        crop: area and ratio limits.

    Returns:
        Boxes inside each image, and flips.
    """
    widths = np.asarray(widths, dtype=np.int64)
    heights = np.asarray(heights, dtype=np.int64)
    u = _uniforms(seed, epoch, np.asarray(hashes, dtype=np.uint64))
    tries = u[:, : 2 * TRIES].reshape(-1, TRIES, 2)
    area = (widths * heights)[:, None] * (crop.min_scale + (crop.max_scale - crop.min_scale) * tries[..., 0])
    log_lo, log_hi = np.log(crop.min_ratio), np.log(crop.max_ratio)
    aspect = np.exp(log_lo + (log_hi - log_lo) * tries[..., 1])
    w = np.rint(np.sqrt(area * aspect)).astype(np.int64)
    h = np.rint(np.sqrt(area / aspect)).astype(np.int64)
    fits = (w > 0) & (h > 0) & (w <= widths[:, None]) & (h <= heights[:, None])
    first = np.argmax(fits, axis=1)
    rows = np.arange(len(widths))
    fw, fh = _fallback(widths, heights, crop)
    found = fits[rows, first]
    cw = np.where(found, w[rows, first], fw)
    ch = np.where(found, h[rows, first], fh)
    tail = u[:, 2 * TRIES:]
    x = np.where(found, np.floor(tail[:, 0] * (widths - cw + 1)), (widths - cw) // 2)
    y = np.where(found, np.floor(tail[:, 1] * (heights - ch + 1)), (heights - ch) // 2)
    boxes = np.stack([x, y, cw, ch], axis=1).astype(np.int32)
    return Crops(boxes=boxes, flips=tail[:, 2] < 0.5)


def centre_crops(widths: np.ndarray, heights: np.ndarray, fraction: float = VAL_CROP_FRACTION) -> Crops:
    """Validation windows: the centre square of side ``fraction`` x the shorter side
    (what resizing the shorter side to ``size / fraction`` then centre-cropping
    ``size`` keeps), no flips."""
    widths = np.asarray(widths, dtype=np.int64)
    heights = np.asarray(heights, dtype=np.int64)
    side = np.maximum(1, np.rint(np.minimum(widths, heights) * fraction)).astype(np.int64)
    boxes = np.stack([(widths - side) // 2, (heights - side) // 2, side, side], axis=1).astype(np.int32)
    return Crops(boxes=boxes, flips=np.zeros(len(widths), dtype=bool))


def sample_crops(
    kind: AugmentKind,
    seed: int,
    epoch: int,
    keys: Sequence[str],
    widths: np.ndarray,
    heights: np.ndarray,
    crop: CropRange,
) -> Crops:
    """The windows and flips of samples named by ``keys``: random (train) or central
    (val, where seed, epoch and ``crop`` play no part)."""
    if kind is AugmentKind.VAL:
        return centre_crops(widths, heights)
    return random_resized_crops(seed, epoch, key_hashes(keys), widths, heights, crop)
