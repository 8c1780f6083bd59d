"""The CPU window decoder (libjpeg-turbo through ``shards/_jpeg.c``): a window's
pixels are exactly a full decode's, reduced DCT scales stay close to a proper
downscale, and bad samples are reported by position."""

from __future__ import annotations

import io

import cv2
import numpy as np
import pytest
from PIL import Image

from core.workers import FairPool
from shards import jpeg

pytestmark = pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))


def _photo_like(width: int, height: int, seed: int) -> np.ndarray:
    """Smooth gradients plus noise: chroma that upsampling edges would show."""
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([xx / width * 255, yy / height * 255, (xx + yy) % 97 * 2.6], axis=2)
    return np.clip(base + rng.normal(0, 20, base.shape), 0, 255).astype(np.uint8)


def _encode(pixels: np.ndarray, mode: str = "RGB", **options) -> np.ndarray:
    out = io.BytesIO()
    Image.fromarray(pixels).convert(mode).save(out, format="JPEG", quality=90, **options)
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


def _full_decode(data: np.ndarray) -> np.ndarray:
    return cv2.cvtColor(cv2.imdecode(data, cv2.IMREAD_COLOR), cv2.COLOR_BGR2RGB)


ENCODINGS = {
    "4:2:0": dict(subsampling=2),
    "4:2:2": dict(subsampling=1),
    "4:4:4": dict(subsampling=0),
    "progressive": dict(subsampling=2, progressive=True),
}


@pytest.mark.parametrize("encoding", list(ENCODINGS))
def test_a_window_is_exactly_the_full_decode_cropped(encoding: str) -> None:
    data = _encode(_photo_like(203, 157, 1), **ENCODINGS[encoding])
    full = _full_decode(data)
    rng = np.random.default_rng(2)
    boxes = [(0, 0, 203, 157), (0, 0, 1, 1), (202, 156, 1, 1), (17, 33, 101, 77), (190, 0, 13, 157)]
    boxes += [tuple(int(v) for v in (x, y, rng.integers(1, 203 - x + 1), rng.integers(1, 157 - y + 1)))
              for x, y in zip(rng.integers(0, 202, 40), rng.integers(0, 156, 40))]
    for x, y, w, h in boxes:
        window = jpeg.decode_window(data, (x, y, w, h))
        assert window.shape == (h, w, 3)
        assert np.array_equal(window, full[y : y + h, x : x + w]), (encoding, (x, y, w, h))


def test_grey_jpegs_come_out_as_rgb() -> None:
    data = _encode(_photo_like(64, 48, 3), mode="L")
    window = jpeg.decode_window(data, (5, 6, 30, 20))
    assert window.shape == (20, 30, 3)
    assert np.array_equal(window, _full_decode(data)[6:26, 5:35])


def test_a_cmyk_jpeg_is_decoded_whole_by_opencv_instead() -> None:
    data = _encode(_photo_like(64, 48, 4), mode="CMYK")
    window = jpeg.decode_window(data, (8, 8, 16, 24))
    assert window.shape == (24, 16, 3)
    assert np.array_equal(window, _full_decode(data)[8:32, 8:24])


@pytest.mark.parametrize(("width", "height", "size", "expected"), [
    (255, 400, 128, 1), (256, 256, 128, 2), (600, 520, 128, 4), (2000, 1100, 128, 8), (4000, 4000, 64, 8),
    (447, 500, 224, 1), (448, 448, 224, 2),
])
def test_the_dct_scale_keeps_the_window_at_least_the_output(width: int, height: int, size: int, expected: int) -> None:
    assert jpeg.dct_denominator(width, height, size) == expected


def _antialiased(src: np.ndarray, size: int) -> np.ndarray:
    import torch

    image = torch.from_numpy(np.ascontiguousarray(src)).permute(2, 0, 1)[None].float()
    out = torch.nn.functional.interpolate(image, size=(size, size), mode="bilinear", antialias=True)
    return out[0].permute(1, 2, 0).round().clamp(0, 255).numpy()


@pytest.mark.parametrize("photo", ["astronaut", "coffee", "chelsea"])
@pytest.mark.parametrize("size", [64, 128])
def test_a_reduced_scale_then_bilinear_is_nearer_a_proper_downscale_than_bilinear_alone(photo: str, size: int) -> None:
    # The IDCT at 1/d low-passes the window; plain bilinear from the full window aliases.
    from skimage import data as photos

    data = _encode(getattr(photos, photo)())
    full = _full_decode(data)
    h, w = full.shape[:2]
    denominator = jpeg.dct_denominator(w, h, size)
    assert denominator >= 2
    window = jpeg.decode_window(data, (0, 0, w, h), denominator)
    assert window.shape == (-(-h // denominator), -(-w // denominator), 3)
    reference = _antialiased(full, size)
    reduced = cv2.resize(window, (size, size), interpolation=cv2.INTER_LINEAR)
    plain = cv2.resize(full, (size, size), interpolation=cv2.INTER_LINEAR)
    assert np.abs(reduced - reference).mean() <= np.abs(plain - reference).mean()
    assert np.abs(reduced - reference).mean() < 4


def test_a_scratch_buffer_that_is_too_small_is_replaced() -> None:
    data = _encode(_photo_like(120, 90, 6))
    window = jpeg.decode_window(data, (0, 0, 120, 90), scratch=np.empty(10, np.uint8))
    assert np.array_equal(window, _full_decode(data))


@pytest.mark.parametrize("damage", ["garbage", "truncated", "bad scan"])
def test_an_undecodable_sample_raises_naming_why(damage: str) -> None:
    data = _encode(_photo_like(96, 96, 7)).tobytes()
    if damage == "garbage":
        data = b"not a jpeg" * 20
    elif damage == "truncated":
        data = data[: len(data) // 2]
    else:
        start = data.index(b"\xff\xda")
        data = data[: start + 6] + b"\x33" + data[start + 7 :]  # tables the file lacks
    with pytest.raises(jpeg.WindowDecodeError) as caught:
        jpeg.decode_window(np.frombuffer(data, np.uint8), (0, 60, 96, 30))
    assert str(caught.value)


def test_a_batch_reports_its_failures_by_position_and_decodes_the_rest() -> None:
    good = [_encode(_photo_like(80 + 8 * i, 60, i)) for i in range(5)]
    bad = np.frombuffer(b"\xff\xd8" + b"\x00" * 100, np.uint8)
    samples = [good[0], bad, good[1], good[2], bad, good[3], good[4]]
    boxes = np.array([[4, 4, 40, 30]] * len(samples))
    workers = FairPool(2)
    decoder = jpeg.WindowDecoder(workers.lane(), arenas=2)
    try:
        for _ in range(3):  # arenas are reused from batch to batch
            windows, failed = decoder.submit(samples, boxes, np.ones(len(samples), int)).result()
            assert sorted(failed) == [1, 4]
            for i, sample in enumerate(samples):
                if i not in failed:
                    assert np.array_equal(windows[i], _full_decode(sample)[4:34, 4:44])
    finally:
        workers.close()


def test_batches_in_flight_never_share_buffers_and_given_back_ones_are_reused() -> None:
    samples = [_encode(_photo_like(64, 48, i)) for i in range(4)]
    boxes = np.array([[0, 0, 64, 48]] * len(samples))
    workers = FairPool(2)
    decoder = jpeg.WindowDecoder(workers.lane(), arenas=1)
    try:
        batches = [decoder.submit(samples, boxes, np.ones(len(samples), int)) for _ in range(3)]  # more than kept
        buffers = [{w.base.ctypes.data for w in b.result()[0]} for b in batches]
        assert not (buffers[0] & buffers[1]) and not (buffers[1] & buffers[2]) and not (buffers[0] & buffers[2])
        for b in batches:
            decoder.recycle(b)
        again = decoder.submit(samples, boxes, np.ones(len(samples), int))
        assert {w.base.ctypes.data for w in again.result()[0]} in buffers  # one arena kept, and reused
        part = decoder.submit(samples, boxes, np.ones(len(samples), int), positions=[2], own_buffers=True)
        windows, failed = part.result()
        assert not failed and part.arena is None
        assert np.array_equal(windows[2], _full_decode(samples[2])) and windows[0].size == 0
    finally:
        workers.close()


# --- restart markers ------------------------------------------------------------


def _restart_markers(data: bytes) -> int:
    return sum(data.count(bytes([0xFF, 0xD0 + n])) for n in range(8))


@pytest.mark.parametrize("encoding", list(ENCODINGS) + ["grey"])
@pytest.mark.parametrize("interval", [1, 2, 4])
def test_restart_markers_keep_every_pixel_and_windows_decode_exactly(encoding: str, interval: int) -> None:
    # 211 x 149: neither side a whole number of MCUs.
    pixels = _photo_like(211, 149, 8)
    original = _encode(pixels, mode="L") if encoding == "grey" else _encode(pixels, **ENCODINGS[encoding])
    rewritten = np.frombuffer(jpeg.add_restarts(original.tobytes(), interval), np.uint8)
    assert _restart_markers(rewritten.tobytes()) > 0
    full = _full_decode(original)
    assert np.array_equal(_full_decode(rewritten), full), "lossless: the same coefficients"
    rng = np.random.default_rng(9)
    boxes = [(0, 0, 211, 149), (0, 0, 1, 1), (210, 148, 1, 1), (100, 60, 3, 2), (33, 17, 150, 100)]
    boxes += [tuple(int(v) for v in (x, y, rng.integers(1, 211 - x + 1), rng.integers(1, 149 - y + 1)))
              for x, y in zip(rng.integers(0, 210, 30), rng.integers(0, 148, 30))]
    for box in boxes:
        x, y, w, h = box
        assert np.array_equal(jpeg.decode_window(rewritten, box), full[y : y + h, x : x + w]), box
        for denominator in (2, 4):
            # At a reduced scale too: the same pixels as the window of the whole JPEG.
            assert np.array_equal(jpeg.decode_window(rewritten, box, denominator),
                                  jpeg.decode_window(original, box, denominator)), (box, denominator)


def test_restart_intervals_tile_the_mcu_rows() -> None:
    # 4:2:0, 208 px: 13 MCUs a row, a prime: only an interval of 1 tiles it.
    data = jpeg.add_restarts(_encode(_photo_like(208, 64, 10)).tobytes(), 4)
    assert _restart_markers(data) == 13 * 4 - 1
    # 256 px: 16 MCUs a row, an interval of 4: 4 intervals a row, 4 rows.
    data = jpeg.add_restarts(_encode(_photo_like(256, 64, 10)).tobytes(), 4)
    assert _restart_markers(data) == 4 * 4 - 1


def test_restart_markers_keep_app_markers_and_make_progressive_jpegs_sequential() -> None:
    exif = Image.Exif()
    exif[0x0112] = 6  # orientation
    out = io.BytesIO()
    Image.fromarray(_photo_like(96, 64, 11)).save(out, format="JPEG", progressive=True, exif=exif.tobytes(),
                                                    comment=b"a comment")
    rewritten = jpeg.add_restarts(out.getvalue())
    with Image.open(io.BytesIO(rewritten)) as image:
        assert image.getexif().get(0x0112) == 6
        assert image.info.get("comment") == b"a comment"
        assert not image.info.get("progressive")
    assert b"\xff\xc2" not in rewritten[: rewritten.index(b"\xff\xda")]


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_restart_markers_refuse_what_libjpeg_cannot_read(damage: str) -> None:
    data = _encode(_photo_like(96, 96, 12)).tobytes()
    data = b"not a jpeg" * 20 if damage == "garbage" else data[: len(data) // 2]
    with pytest.raises(jpeg.JpegError):
        jpeg.add_restarts(data)


def test_a_window_of_a_jpeg_whose_intervals_lie_is_still_decoded() -> None:
    # A restart marker missing: the intervals are not what the header promises, so the
    # window is decoded from the JPEG as it is (libjpeg resynchronises and warns).
    data = bytearray(jpeg.add_restarts(_encode(_photo_like(128, 128, 13)).tobytes(), 2))
    at = data.index(b"\xff\xd3")
    del data[at : at + 2]
    window = jpeg.decode_window(np.frombuffer(bytes(data), np.uint8), (64, 96, 32, 32))
    assert window.shape == (32, 32, 3)


def test_damaged_bytes_anywhere_give_a_window_or_an_error_never_a_crash() -> None:
    # Flipped bytes in the headers or in the intervals: the decoder (and the cutting of
    # intervals around the window) must stay inside the data whatever they say.
    data = jpeg.add_restarts(_encode(_photo_like(160, 120, 14)).tobytes(), 2)
    rng = np.random.default_rng(15)
    for _ in range(300):
        damaged = bytearray(data)
        for at in rng.integers(2, len(damaged), rng.integers(1, 4)):
            damaged[at] = int(rng.integers(0, 256))
        try:
            window = jpeg.decode_window(np.frombuffer(bytes(damaged), np.uint8), (40, 30, 64, 48))
        except jpeg.WindowDecodeError:
            continue
        assert window.ndim == 3 and window.shape[2] == 3


def test_without_the_library_the_pipeline_uses_dali_and_the_sharder_keeps_the_bytes(monkeypatch) -> None:
    from core.errors import ConfigError
    from decode.pipeline import PipelineSpec
    from decode.registry import check_cpu_decoder, decoder_name
    from sharder.images import ProcessedImage
    from sharder.normalise import with_restarts

    monkeypatch.setattr(jpeg, "_library", lambda: "shards/_jpeg*.so was not built (test)")
    assert not jpeg.available() and "not built" in str(jpeg.unavailable_reason())
    assert decoder_name(PipelineSpec()) == "dali"
    with pytest.raises(ConfigError, match="not built"):
        check_cpu_decoder("libjpeg-turbo")
    data = _encode(_photo_like(32, 32, 16)).tobytes()
    assert with_restarts(ProcessedImage(data, 32, 32), 2).data == data


def test_strict_restart_markers_refuse_corrupt_entropy_data_that_decoders_only_warn_about() -> None:
    from tests.sharder.odd_files import corrupt_scan_jpeg

    data = corrupt_scan_jpeg()
    assert jpeg.add_restarts(data)  # read whole, with warnings: kept unless strict
    with pytest.raises(jpeg.JpegError, match="corrupt data"):
        jpeg.add_restarts(data, strict=True)
    assert jpeg.add_restarts(_encode(_photo_like(64, 64, 17)).tobytes(), strict=True)
