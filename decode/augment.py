"""A sample's augmentation as a pure function of (seed, epoch, sample key): its crop
window, its flip and its photometric factors, all drawn here.

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

The photometric steps (:class:`Jitter`, ColorJitter-style, each off by default) draw
one factor per sample from the Philox block after the crop's, so turning them on
changes no crop or flip; validation draws none. What they do to the pixels is the
finishing stage's (:mod:`decode.finish`), on every decode path alike.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, fields

import numpy as np

from core.errors import ConfigError
from protocol.request import AugmentKind, CropRange

__all__ = [
    "VAL_CROP_FRACTION",
    "Crops",
    "Jitter",
    "Tone",
    "centre_crops",
    "key_hashes",
    "philox4x32",
    "random_resized_crops",
    "sample_crops",
    "sample_tone",
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
# The block after those: one word per photometric step, in Tone's field order.
_TONE_BLOCK = _BLOCKS


@dataclass(frozen=True)
class Jitter:
    """Photometric steps of training samples, ColorJitter-style: each draws a factor
    per sample (from seed, epoch and key, as the crops) and is off at 0, the default.
    Validation samples are never jittered.

    Args:
        jitter_brightness: each training sample's values are multiplied by a factor
            drawn uniformly between max(0, 1 - b) and 1 + b (torchvision's
            ColorJitter ``brightness``), e.g. 0.4; 0: off.
        jitter_contrast: each training sample's values' distance from mid-grey (128)
            is multiplied by a factor drawn likewise (torchvision's ColorJitter
            ``contrast``, which scales about the image's mean grey instead), e.g. 0.4;
            0: off.
    """

    jitter_brightness: float = 0.0
    jitter_contrast: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if not (math.isfinite(value) and value >= 0):  # NaN fails too
                raise ConfigError(f"{f.name}: must be a number >= 0 (0: off), got {value}")

    @property
    def on(self) -> bool:
        """Whether any step is on."""
        return any(getattr(self, f.name) for f in fields(self))

    def pixel_options(self) -> dict[str, str]:
        """The steps that are on, by option name, as the daemon's pixel options name
        them (:func:`protocol.identity.pixel_options`): none while all are off, so a
        daemon reports what it did before they existed."""
        return {f.name: repr(float(getattr(self, f.name))) for f in fields(self) if getattr(self, f.name)}


@dataclass(frozen=True)
class Tone:
    """Per-sample photometric factors of one batch, float32 ``[N]`` each (1: unchanged).

    Attributes:
        brightness: values multiplied by it (after the contrast).
        contrast: values' distance from mid-grey multiplied by it.
    """

    brightness: np.ndarray
    contrast: np.ndarray

    @classmethod
    def unchanged(cls, n: int) -> Tone:
        """Factors of ``n`` samples that change nothing."""
        return cls(**{f.name: np.ones(n, dtype=np.float32) for f in fields(cls)})

    def rows(self, rows: np.ndarray) -> Tone:
        """The factors of the samples at ``rows`` alone."""
        return Tone(**{f.name: getattr(self, f.name)[rows] for f in fields(self)})


@dataclass(frozen=True)
class Crops:
    """Per-sample augmentation of one batch: crop windows, flips, photometric factors.

    Attributes:
        boxes: int32 ``[N, 4]``: x, y, width, height in original pixels.
        flips: bool ``[N]``: mirror horizontally after the resize.
        tone: the photometric factors; None: none drawn (all steps off, or validation).
    """

    boxes: np.ndarray
    flips: np.ndarray
    tone: Tone | None = None

    def __len__(self) -> int:
        return len(self.boxes)

    def rows(self, positions: Sequence[int] | np.ndarray) -> Crops:
        """The crops of the samples at ``positions`` alone, in that order."""
        rows = np.asarray(positions, dtype=np.intp)
        tone = None if self.tone is None else self.tone.rows(rows)
        return Crops(boxes=self.boxes[rows], flips=self.flips[rows], tone=tone)


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


def _uniforms(seed: int, epoch: int, hashes: np.ndarray, first: int = 0, blocks: int = _BLOCKS) -> np.ndarray:
    """float64 ``[N, 4 * blocks]`` in [0, 1): each sample's draws of Philox blocks
    ``first`` to ``first + blocks - 1`` (the crop's are the first ``_BLOCKS``)."""
    n = len(hashes)
    counters = np.zeros((n, blocks, 4), dtype=np.uint32)
    counters[:, :, 0] = np.arange(first, first + blocks, dtype=np.uint32)
    counters[:, :, 2] = (hashes & _LOW32).astype(np.uint32)[:, None]
    counters[:, :, 3] = (hashes >> np.uint64(32)).astype(np.uint32)[:, None]
    words = philox4x32(counters.reshape(-1, 4), _stream_key(seed, epoch))
    return words.reshape(n, 4 * blocks) * (1.0 / 2**32)


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


def _factors(u: np.ndarray, spread: float) -> np.ndarray:
    """ColorJitter's factors: uniform in [max(0, 1 - spread), 1 + spread], float32."""
    low = max(0.0, 1.0 - spread)
    return (low + (1.0 + spread - low) * u).astype(np.float32)


def sample_tone(seed: int, epoch: int, hashes: np.ndarray, jitter: Jitter) -> Tone | None:
    """The photometric factors of samples (their :func:`key_hashes`), each step's from
    its own word of the block after the crop's; None where every step is off."""
    if not jitter.on:
        return None
    u = _uniforms(seed, epoch, np.asarray(hashes, dtype=np.uint64), first=_TONE_BLOCK, blocks=1)
    return Tone(brightness=_factors(u[:, 0], jitter.jitter_brightness),
                contrast=_factors(u[:, 1], jitter.jitter_contrast))


def sample_crops(
    kind: AugmentKind,
    seed: int,
    epoch: int,
    keys: Sequence[str],
    widths: np.ndarray,
    heights: np.ndarray,
    crop: CropRange,
    jitter: Jitter = Jitter(),
) -> Crops:
    """The augmentation of samples named by ``keys``, the one place it is drawn:
    random windows and flips, and the photometric factors ``jitter`` asks for (train),
    or central windows alone (val, where seed, epoch, ``crop`` and ``jitter`` play no
    part)."""
    if kind is AugmentKind.VAL:
        return centre_crops(widths, heights)
    hashes = key_hashes(keys)
    crops = random_resized_crops(seed, epoch, hashes, widths, heights, crop)
    return Crops(crops.boxes, crops.flips, sample_tone(seed, epoch, hashes, jitter))
