"""The CPU resize against reference resizes: same window, same filter, within 1 level."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from core.workers import FairPool
from feeder.resize import BatchResizer


def _photo_like(height: int, width: int, seed: int) -> np.ndarray:
    # Smooth gradients plus mild noise: closer to photographs than white noise.
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    base = np.stack([x * 255 / width, y * 255 / height, (x + y) * 127 / (width + height)], axis=-1)
    waves = 40 * np.sin(x[..., None] / (3 + seed)) * np.cos(y[..., None] / 5)
    return np.clip(base + waves + rng.normal(0, 8, base.shape), 0, 255).astype(np.uint8)


def _bilinear(image: np.ndarray, size: int) -> np.ndarray:
    """Exact float bilinear, half-pixel centres, no antialiasing (tf.data's filter)."""
    h, w = image.shape[:2]
    ys = np.clip((np.arange(size) + 0.5) * h / size - 0.5, 0, h - 1)
    xs = np.clip((np.arange(size) + 0.5) * w / size - 0.5, 0, w - 1)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, h - 1), np.minimum(x0 + 1, w - 1)
    fy, fx = (ys - y0)[:, None, None], (xs - x0)[None, :, None]
    a = image.astype(np.float64)
    top = a[y0][:, x0] * (1 - fx) + a[y0][:, x1] * fx
    bottom = a[y1][:, x0] * (1 - fx) + a[y1][:, x1] * fx
    return top * (1 - fy) + bottom * fy


IMAGES = [_photo_like(h, w, i) for i, (h, w) in enumerate([(250, 280), (97, 300), (400, 180), (60, 60), (17, 23)])]


@pytest.fixture(scope="module")
def resizer():
    workers = FairPool(2)
    yield BatchResizer(workers.lane())
    workers.close()


@pytest.mark.parametrize("size", [224, 128, 32])
def test_plain_bilinear_matches_an_exact_bilinear_resize(resizer, size):
    out = resizer.resize(IMAGES, size, np.zeros(len(IMAGES), bool), antialias=False)
    assert out.shape == (len(IMAGES), size, size, 3) and out.dtype == np.uint8
    for image, got in zip(IMAGES, out):
        assert np.abs(got - _bilinear(image, size)).max() <= 1.0


@pytest.mark.parametrize("size", [224, 128, 32])
def test_antialiased_bilinear_matches_pillow(resizer, size):
    out = resizer.resize(IMAGES, size, np.zeros(len(IMAGES), bool), antialias=True)
    for image, got in zip(IMAGES, out):
        reference = np.asarray(Image.fromarray(image).resize((size, size), Image.BILINEAR))
        assert np.abs(got.astype(int) - reference).max() <= 1


def test_the_filters_differ_when_downscaling(resizer):
    flips = np.zeros(len(IMAGES), bool)
    plain, smooth = (resizer.resize(IMAGES[:1], 32, flips, antialias=a).astype(int) for a in (False, True))
    assert np.abs(plain - smooth).mean() > 2


def test_flagged_images_are_mirrored(resizer):
    flips = np.array([True, False, True, False, False])
    straight = resizer.resize(IMAGES, 40, np.zeros(5, bool))
    mixed = resizer.resize(IMAGES, 40, flips)
    for i, flip in enumerate(flips):
        assert np.array_equal(mixed[i], straight[i][:, ::-1] if flip else straight[i])
