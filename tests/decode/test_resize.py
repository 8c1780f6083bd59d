"""The CPU resize against reference resizes: same window, same filter, within 1 level;
the C resize's two paths against each other, byte for byte."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import cv2
import numpy as np
import pytest
from PIL import Image

from core.workers import FairPool
from decode import resize
from decode.resize import BatchResizer
from shards import jpeg


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


def _windows(count: int, seed: int) -> list[np.ndarray]:
    """Windows of a larger image (strided rows), some at its right and bottom edges,
    from 1x1 up to larger than 224 px: upscaled and downscaled."""
    rng = np.random.default_rng(seed)
    image = _photo_like(300, 340, seed)
    out = [image[-7:, -5:], image[:1, :1], image[:1, :], image[:, -1:], image]
    while len(out) < count:
        w, h = int(rng.integers(1, 341)), int(rng.integers(1, 301))
        x, y = int(rng.integers(0, 341 - w)), int(rng.integers(0, 301 - h))
        out.append(image[y : y + h, x : x + w])
    return out


needs_native = pytest.mark.skipif(resize.native_unavailable_reason() is not None,
                                  reason=str(resize.native_unavailable_reason()))


def test_the_c_resize_is_built_wherever_the_jpeg_library_is():
    # Both are built by the same compiler at install: one without the other is a build fault.
    if jpeg.available():
        assert resize.native_unavailable_reason() is None


@needs_native
@pytest.mark.parametrize("size", [224, 31])
def test_the_c_resize_s_simd_and_portable_paths_write_the_same_bytes(size):
    windows = _windows(40, seed=size)
    flips = np.arange(len(windows)) % 3 == 0
    fast, portable = (np.empty((len(windows), size, size, 3), np.uint8) for _ in range(2))
    for out, simd in ((fast, True), (portable, False)):
        assert resize.NativeBatch(resize._items(windows, out, flips)).resize(simd=simd) == len(windows)
    assert np.array_equal(fast, portable)
    for window, got, flip in zip(windows, fast, flips):
        want = _bilinear(window, size)
        assert np.abs(got - (want[:, ::-1] if flip else want)).max() <= 1.0


@needs_native
def test_every_image_of_a_batch_not_a_multiple_of_a_call_is_resized(resizer):
    windows = _windows(19, seed=3)
    flips = np.arange(19) % 2 == 1
    out = np.zeros((19, 48, 48, 3), np.uint8)
    resizer.resize(windows, 48, flips, out=out)
    for window, got, flip in zip(windows, out, flips):
        want = cv2.resize(window, (48, 48), interpolation=cv2.INTER_LINEAR)
        assert np.abs(got.astype(int) - (want[:, ::-1] if flip else want)).max() <= 1


@needs_native
def test_calls_sharing_a_batch_resize_each_image_once():
    windows = _windows(64, seed=9)
    out = np.zeros((64, 64, 64, 3), np.uint8)
    batch = resize.NativeBatch(resize._items(windows, out, np.zeros(64, bool)))
    with ThreadPoolExecutor(3) as threads:
        done = list(threads.map(lambda _: batch.resize(), range(3)))
    assert sum(done) == 64 and batch.resize() == 0
    for window, got in zip(windows, out):
        assert np.abs(got - _bilinear(window, 64)).max() <= 1.0


def test_images_whose_pixels_are_not_packed_are_resized_by_opencv(resizer):
    spaced = _photo_like(120, 200, 5)[:, ::2]  # every other column: pixels 6 bytes apart
    assert resize._items([spaced], np.empty((1, 40, 40, 3), np.uint8), np.zeros(1, bool)) is None
    out = resizer.resize([spaced, IMAGES[0]], 40, np.zeros(2, bool))
    assert np.abs(out[0] - _bilinear(spaced, 40)).max() <= 1.0


@needs_native
def test_an_empty_window_is_an_error_that_names_it(resizer):
    windows = [IMAGES[0], IMAGES[1][:0], IMAGES[2]]
    with pytest.raises(ValueError, match="image 1 of the batch: 300x0"):
        resizer.resize(windows, 32, np.zeros(3, bool))
