"""The decoded cache's own rules: sizes, the memory check, admit-until-full accounting,
window mapping and the downscaled decode."""

from __future__ import annotations

import cv2
import numpy as np
import pytest

from core.cli import parse_bytes
from core.errors import ConfigError
from decode.decoded_cache import (
    ENTRY_OVERHEAD_BYTES,
    DecodedCache,
    cached_windows,
    check_budget,
    decode_downscaled,
)
from feeder.config import ServerConfig
from feeder.config_values import physical_memory_bytes


@pytest.mark.parametrize(("text", "expected"), [
    ("0", 0), ("1234", 1234), ("512M", 512 << 20), ("8G", 8 << 30), ("8GiB", 8 << 30), ("1.5k", 1536),
])
def test_sizes_parse_as_powers_of_1024(text, expected):
    assert parse_bytes(text, "--decoded-cache-bytes") == expected


@pytest.mark.parametrize("text", ["", "G", "-1G", "8 gallons"])
def test_a_size_that_is_not_one_is_refused(text):
    with pytest.raises(ConfigError, match="--decoded-cache-bytes"):
        parse_bytes(text, "--decoded-cache-bytes")


def test_budget_larger_than_memory_is_refused_with_both_numbers():
    with pytest.raises(ConfigError) as caught:
        check_budget(3 << 30, memory_bytes=2 << 30)
    assert str(3 << 30) in str(caught.value) and str(2 << 30) in str(caught.value)
    check_budget(2 << 30, memory_bytes=2 << 30)


def test_server_config_refuses_a_budget_above_this_machine_at_start(tmp_path):
    memory = physical_memory_bytes()
    with pytest.raises(ConfigError, match=f"decoded_cache_bytes: {memory + 1} bytes.*{memory} bytes"):
        ServerConfig.of(datasets={"d": tmp_path}, decoded_cache_bytes=memory + 1)


@pytest.mark.parametrize(("field", "value"), [("decoded_cache_bytes", -1), ("decoded_cache_side", 0)])
def test_server_config_refuses_negative_cache_settings(tmp_path, field, value):
    with pytest.raises(ConfigError, match=field):
        ServerConfig.of(datasets={"d": tmp_path}, **{field: value})


def test_zero_means_off_by_default(tmp_path):
    assert ServerConfig.of(datasets={"d": tmp_path}).decoded_cache.decoded_cache_bytes == 0


def _image(height: int, width: int, value: int = 7) -> np.ndarray:
    return np.full((height, width, 3), value, dtype=np.uint8)


def test_admits_until_full_then_stops_and_never_exceeds_the_budget():
    one = _image(10, 10).nbytes + ENTRY_OVERHEAD_BYTES
    cache = DecodedCache(budget_bytes=3 * one + one // 2, side=16)
    held = [cache.admit(("d", "train", i), _image(10, 10, i)) for i in range(6)]
    assert held == [True, True, True, False, False, False]
    usage = cache.usage()
    assert (usage.entries, usage.used_bytes, usage.admitting) == (3, 3 * one, False)
    assert usage.used_bytes <= usage.budget_bytes
    assert cache.get(("d", "train", 0))[0, 0, 0] == 0, "admitted entries stay: no eviction"
    assert cache.get(("d", "train", 4)) is None


def test_a_stopped_cache_admits_nothing_even_small_images():
    one = _image(10, 10).nbytes + ENTRY_OVERHEAD_BYTES
    cache = DecodedCache(budget_bytes=2 * one, side=16)
    assert cache.admit("a", _image(10, 10)) and not cache.admit("big", _image(40, 40))
    assert not cache.admit("small", _image(2, 2)), "admission stops at the first image that does not fit"


def test_admitting_a_key_twice_counts_it_once_and_cached_pixels_are_read_only():
    cache = DecodedCache(budget_bytes=1 << 20, side=16)
    image = _image(10, 10)
    assert cache.admit("k", image) and cache.admit("k", _image(10, 10, 9))
    assert cache.usage().entries == 1 and cache.get("k")[0, 0, 0] == 7
    with pytest.raises(ValueError):
        image[0, 0, 0] = 1


def test_windows_map_into_the_cached_image_in_proportion():
    boxes = np.array([[0, 0, 400, 300], [100, 30, 200, 150], [399, 299, 1, 1]])
    widths, heights = np.full(3, 400), np.full(3, 300)
    same = cached_windows(boxes, widths, heights, np.array([[300, 400]] * 3))
    assert same.tolist() == [[0, 0, 400, 300], [100, 30, 300, 180], [399, 299, 400, 300]]
    half = cached_windows(boxes, widths, heights, np.array([[150, 200]] * 3))
    assert half.tolist() == [[0, 0, 200, 150], [50, 15, 150, 90], [199, 149, 200, 150]]
    assert (half[:, 2] > half[:, 0]).all() and (half[:, 3] > half[:, 1]).all(), "never empty"


def _jpeg(height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(0)
    pixels = cv2.GaussianBlur(rng.integers(0, 256, (height, width, 3), dtype=np.uint8), (9, 9), 3)
    ok, data = cv2.imencode(".jpg", pixels, [cv2.IMWRITE_JPEG_QUALITY, 95])
    assert ok
    return data.reshape(-1)


@pytest.mark.parametrize(("height", "width", "side", "expected"), [
    (300, 400, 256, (256, 341)),   # factor < 2: resize only
    (600, 1000, 256, (256, 427)),  # DCT 1/2 first
    (2100, 2800, 256, (256, 341)), # DCT 1/8 first
    (100, 120, 256, (100, 120)),   # smaller than the side: kept as decoded
])
def test_decode_downscaled_keeps_the_shorter_side_at_most_side(height, width, side, expected):
    image = decode_downscaled(_jpeg(height, width), side, min(height, width))
    assert image is not None and image.shape == (*expected, 3) and image.dtype == np.uint8


def test_decode_downscaled_is_close_to_a_full_decode_then_resize():
    data = _jpeg(600, 1000)
    full = cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)
    reference = cv2.resize(full, (427, 256), interpolation=cv2.INTER_AREA).astype(np.int16)
    image = decode_downscaled(data, 256, 600)
    assert image is not None
    assert np.abs(image.astype(np.int16) - reference).mean() < 2.0


def test_bytes_that_do_not_decode_give_none():
    assert decode_downscaled(np.zeros(500, dtype=np.uint8), 256, 300) is None
