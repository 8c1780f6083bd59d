"""sharder.images: pass-through, normalisation and rejection of single inputs."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from sharder.images import parse_jpeg_header, process_image
from tests.sharder.odd_files import corrupt_scan_jpeg, encode, forged_size_jpeg, huge_jpeg, odd_inputs, rgb_jpeg

ODD = odd_inputs()


@pytest.mark.parametrize("name", sorted(ODD))
def test_each_kind_of_input_gets_its_outcome(name: str) -> None:
    data, expected = ODD[name]
    result = process_image(data)
    if expected == "reject":
        assert result.reject and not result.data
        return
    assert not result.reject
    if expected == "pass":
        assert result.data == data and not result.reencoded
    else:
        assert result.reencoded and result.data[:2] == b"\xff\xd8"
        with Image.open(io.BytesIO(result.data)) as image:
            assert image.format == "JPEG" and image.mode == "RGB"
    assert (result.width, result.height) == Image.open(io.BytesIO(data)).size


def _mean_rgb(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as image:
        if image.mode.startswith("I;16"):  # Pillow's own RGB conversion clips; scale to 8 bits
            return np.full(3, np.asarray(image, dtype=np.float64).mean() / 257)
        return np.asarray(image.convert("RGB"), dtype=np.float64).mean(axis=(0, 1))


@pytest.mark.parametrize("name", ["cmyk.JPEG", "png_disguised.JPEG", "palette.png", "sixteen_bit.png"])
def test_normalised_images_keep_their_colours(name: str) -> None:
    data = ODD[name][0]
    before = _mean_rgb(data)
    after = _mean_rgb(process_image(data).data)
    assert np.abs(before - after).max() < 6.0


def test_alpha_is_composited_over_white() -> None:
    transparent = Image.new("RGBA", (20, 10), (0, 0, 0, 0))
    result = process_image(encode(transparent, "PNG"))
    assert _mean_rgb(result.data).min() > 250


def test_reject_reasons_name_the_problem() -> None:
    assert process_image(b"").reject == "empty file"
    assert "truncated" in process_image(ODD["truncated.JPEG"][0]).reject
    assert "not an image" in process_image(ODD["text.jpg"][0]).reject


def test_header_parse_reads_size_components_and_progressive() -> None:
    header = parse_jpeg_header(rgb_jpeg(0, progressive=True))
    assert header is not None
    assert (header.width, header.height, header.components, header.precision_bits) == (40, 30, 3, 8)
    assert header.progressive and header.passes_through
    cmyk = parse_jpeg_header(ODD["cmyk.JPEG"][0])
    assert cmyk is not None and cmyk.components == 4 and not cmyk.passes_through
    assert parse_jpeg_header(b"\x89PNG\r\n") is None


def test_max_side_downscales_and_quality_reencodes() -> None:
    data = rgb_jpeg(0)
    small = process_image(data, max_side_px=20)
    assert small.reencoded and max(small.width, small.height) == 20
    assert Image.open(io.BytesIO(small.data)).size == (small.width, small.height)
    assert process_image(data, max_side_px=100).data == data  # already small enough: untouched
    requality = process_image(data, quality=30)
    assert requality.reencoded and len(requality.data) < len(data)


def test_corrupt_scan_data_is_rejected_only_by_a_decode() -> None:
    data = corrupt_scan_jpeg()
    assert process_image(data, check="header").data == data  # headers and end marker are fine
    result = process_image(data, check="decode")
    assert not result.data and "corrupt" in result.reject, result.reject
    assert process_image(rgb_jpeg(3), check="decode").data == rgb_jpeg(3)


@pytest.fixture(scope="module")
def huge() -> bytes:
    return huge_jpeg()


@pytest.mark.slow
def test_a_decompression_bomb_is_rejected_without_a_decode_or_downscaled(huge: bytes) -> None:
    result = process_image(huge)
    assert not result.data and "20000x20000" in result.reject and "--max-pixels" in result.reject
    assert "--max-pixels" in process_image(huge, max_pixels=10_000_000, check="header").reject
    small = process_image(huge, max_side_px=500)
    assert not small.reject and (small.width, small.height) == (500, 500)


@pytest.mark.slow
def test_a_jpeg_claiming_more_pixels_than_its_data_holds_is_rejected_downscaled_or_not() -> None:
    forged = forged_size_jpeg(65000)
    assert "65000x65000" in process_image(forged).reject  # over --max-pixels, by its header
    downscaled = process_image(forged, max_side_px=128)  # decoded at 1/8: 8125 x 8125 from a few KB
    assert not downscaled.data and downscaled.reject.startswith("corrupt image: decoder reports corrupt data"), \
        downscaled.reject
    assert process_image(forged, max_side_px=128, check="header").data  # a header check lets it through


def test_a_reencoded_jpeg_with_corrupt_scan_data_is_rejected() -> None:
    corrupt = corrupt_scan_jpeg()
    for options in ({"quality": 50}, {"max_side_px": 64}):
        result = process_image(corrupt, **options)
        assert not result.data and "corrupt" in result.reject, (options, result.reject)
    good = process_image(rgb_jpeg(3), quality=50)
    assert good.reencoded and not good.reject
