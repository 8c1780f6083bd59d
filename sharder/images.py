"""Turn one input file into the JPEG bytes that go into a shard, or a reject reason.

Valid baseline or progressive 8-bit JPEGs (RGB/YCbCr or grayscale) pass through
(byte for byte here; ``sharder.normalise`` then adds restart markers losslessly). With
``check="decode"`` (the default) each is fully decoded first (:func:`check_by_decode`,
where no restart markers are added) and rejected if the decoder reports anything;
``check="header"`` parses the headers and checks the end-of-image marker only.
Everything else that Pillow can fully decode (CMYK JPEG, PNG even when named
``.JPEG``, RGBA, palette, 16-bit, BMP, WebP, ...) is normalised to an RGB JPEG. The
format is read from the content, never from the file name. Images over
``max_pixels`` are rejected before any decode (decompression bombs), or downscaled in
the DCT domain when ``max_side_px`` is given. With ``check="decode"`` a JPEG that is
re-encoded (downscaled, or at another quality) is decode-checked too: Pillow says
nothing about corrupt entropy-coded data (it fills the rest with grey), so a JPEG
whose header claims 65000x65000 over a small image's data would become a one-colour
sample with a real label.
"""

from __future__ import annotations

import io
import os
import tempfile
import threading
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
from PIL import Image, UnidentifiedImageError

from core.bad_input import DEFAULT_MAX_PIXELS
from sharder.config import CHECKS

__all__ = [
    "CHECKS",
    "DEFAULT_MAX_PIXELS",
    "JpegHeader",
    "ProcessedImage",
    "check_by_decode",
    "check_without_decode",
    "decode_and_reencode",
    "decoded_size",
    "parse_jpeg_header",
    "process_image",
]

_DECODE_LOCK = threading.Lock()  # decoding redirects this process's stderr and Pillow's limit

_SOI = b"\xff\xd8"
_EOI = b"\xff\xd9"
# Start-of-frame markers (all except DHT C4, JPG C8, DAC CC), and the progressive ones.
_SOF_MARKERS = {0xC0, 0xC1, 0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
_PROGRESSIVE = {0xC2, 0xC6, 0xCA, 0xCE}
_BASIC_FRAMES = {0xC0, 0xC1, 0xC2}  # Huffman-coded: what every JPEG decoder reads
_STANDALONE = set(range(0xD0, 0xD8)) | {0x01}  # RSTn, TEM: no length field


@dataclass(frozen=True)
class JpegHeader:
    """What the frame header of a JPEG says."""

    width: int
    height: int
    components: int
    precision_bits: int
    marker: int

    @property
    def progressive(self) -> bool:
        return self.marker in _PROGRESSIVE

    @property
    def passes_through(self) -> bool:
        """True when any JPEG decoder (nvJPEG, libjpeg-turbo) reads it as RGB as is."""
        return self.marker in _BASIC_FRAMES and self.precision_bits == 8 and self.components in (1, 3)


@dataclass(frozen=True)
class ProcessedImage:
    """The outcome for one input: ``data`` is a JPEG, or ``reject`` says why not."""

    data: bytes = b""
    width: int = 0
    height: int = 0
    reencoded: bool = False
    reject: str = ""
    half: bytes = b""  # the half-scale copy (--half-copies), or none


def parse_jpeg_header(data: bytes) -> JpegHeader | None:
    """The frame header of ``data`` if it is a JPEG with a complete header, else None.

    Walks the marker segments from SOI to the first start-of-frame segment.
    """
    if not data.startswith(_SOI):
        return None
    pos, end = 2, len(data)
    while pos + 4 <= end:
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker in _STANDALONE:
            pos += 2
            continue
        length = int.from_bytes(data[pos + 2 : pos + 4], "big")
        if marker in _SOF_MARKERS:
            if length < 8 or pos + 2 + length > end:
                return None
            seg = data[pos + 4 : pos + 2 + length]
            return JpegHeader(
                width=int.from_bytes(seg[3:5], "big"),
                height=int.from_bytes(seg[1:3], "big"),
                components=seg[5],
                precision_bits=seg[0],
                marker=marker,
            )
        if marker in (0xDA, 0xD9) or length < 2:  # scan or end before any frame header
            return None
        pos += 2 + length
    return None


def _ends_with_eoi(data: bytes) -> bool:
    # Some encoders pad after EOI with zero bytes or a newline; tolerate that.
    return data.rstrip(b"\x00\r\n").endswith(_EOI)


def _encode_rgb(image: Image.Image, quality: int) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="JPEG", quality=quality)
    return buffer.getvalue()


def _to_rgb(image: Image.Image) -> Image.Image:
    """RGB view of any Pillow image; alpha is composited over white, 16-bit scaled."""
    if image.mode in ("I;16", "I;16B", "I;16L", "I"):
        image = image.point(lambda value: value / 257).convert("L")  # 16-bit -> 8-bit
    if image.mode == "P":
        image = image.convert("RGBA" if "transparency" in image.info else "RGB")
    if image.mode in ("RGBA", "LA", "PA"):
        background = Image.new("RGBA", image.size, (255, 255, 255, 255))
        image = Image.alpha_composite(background, image.convert("RGBA"))
    return image.convert("RGB")


def _shrunk(image: Image.Image, max_side_px: int | None) -> Image.Image:
    if max_side_px is None or max(image.size) <= max_side_px:
        return image
    ratio = max_side_px / max(image.size)
    size = (max(1, round(image.width * ratio)), max(1, round(image.height * ratio)))
    return image.resize(size, Image.Resampling.LANCZOS)


class _TooManyPixels(ValueError):
    pass


@contextmanager
def _strict_decoding() -> Iterator[list[str]]:
    """Decode under this context to learn what the decoder complained about.

    libjpeg reports corrupt entropy-coded data (bad Huffman code, extraneous bytes,
    a premature end of a data segment) as a *warning*: it prints one line on stderr,
    fills the rest of the image with grey and returns success, so Pillow (like DALI's
    CPU decoder) raises nothing; nvJPEG fails on the same bytes. That line is the only
    evidence, so stderr (fd 2) points to a temporary file while the decode runs and
    the list yielded receives what was written there. Pillow's own pixel limit is
    lifted meanwhile: callers check pixels themselves, against their own limit.
    """
    messages: list[str] = []
    with _DECODE_LOCK, tempfile.TemporaryFile() as capture, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Python-level warnings (EXIF, bomb) are not data errors
        limit, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, None
        saved = os.dup(2)
        os.dup2(capture.fileno(), 2)
        try:
            yield messages
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            Image.MAX_IMAGE_PIXELS = limit
            capture.seek(0)
            messages += [line for line in capture.read().decode(errors="replace").splitlines() if line.strip()]


def _too_many(width: int, height: int, max_pixels: int) -> str:
    return f"image is {width}x{height} = {width * height:,} pixels, over --max-pixels {max_pixels:,}"


def _load(data: bytes, max_pixels: int, max_side_px: int | None) -> Image.Image:
    """``data`` fully decoded (a JPEG only to about ``max_side_px`` when given).

    Raises:
        UnidentifiedImageError: no known image format.
        _TooManyPixels: over ``max_pixels`` (checked before decoding).
        OSError, ValueError, SyntaxError: corrupt or truncated, or the decoder warned.
    """
    with _strict_decoding() as messages:
        image = Image.open(io.BytesIO(data))
        if max_side_px is not None and image.format == "JPEG":
            image.draft(image.mode, (max_side_px, max_side_px))  # DCT-domain downscale, up to 1/8
        if image.width * image.height > max_pixels:
            raise _TooManyPixels(_too_many(image.width, image.height, max_pixels))
        image.load()
    if messages:
        raise ValueError(f"decoder reports corrupt data: {messages[0]}")
    return image


def _decode_reencode(data: bytes, max_side_px: int | None, quality: int, max_pixels: int,
                     strict: bool) -> ProcessedImage:
    try:
        with _load(data, max_pixels, max_side_px) as image:
            size, is_jpeg = image.size, image.format == "JPEG"
            rgb = _shrunk(_to_rgb(image), max_side_px)
        if strict and is_jpeg:
            _check_decodes(data, size)
    except UnidentifiedImageError:
        return ProcessedImage(reject="not an image (content is no known image format)")
    except _TooManyPixels as e:
        return ProcessedImage(reject=str(e))
    except (OSError, ValueError, SyntaxError) as e:
        reason = "truncated" if "truncated" in str(e) else "corrupt"
        return ProcessedImage(reject=f"{reason} image: {e}")
    return ProcessedImage(_encode_rgb(rgb, quality), rgb.width, rgb.height, reencoded=True)


def _check_decodes(data: bytes, size: tuple[int, int]) -> None:
    """Raise unless the JPEG ``data`` decodes without a decoder warning to ``size``
    (what Pillow made of it), at the DCT scale that gives that size.

    Raises:
        ValueError: the decoder reports corrupt data, or another size.
    """
    header = parse_jpeg_header(data)
    reduction = next((r for r in _REDUCTIONS if header is not None
                      and (-(-header.width // r), -(-header.height // r)) == size), 1)
    decoded = decoded_size(data, reduction)
    if decoded != size:
        raise ValueError(f"decodes to {decoded[0]}x{decoded[1]}, {size[0]}x{size[1]} expected")


_REDUCTIONS = (1, 2, 4, 8)  # libjpeg's DCT-domain scales: 1/1 to 1/8


def decoded_size(data: bytes, reduction: int = 1) -> tuple[int, int]:
    """(width, height) of ``data`` after a full, strict decode (no pixel limit); a
    JPEG at 1/``reduction`` of its size (1, 2, 4 or 8: decoded in the DCT domain).

    JPEGs are decoded by OpenCV: its libjpeg prints the decoder's warnings, which
    :func:`_strict_decoding` collects (Pillow's decoder silences them).

    Raises:
        OSError, ValueError, SyntaxError: the image does not decode cleanly.
    """
    if not data.startswith(_SOI):
        with _load(data, max_pixels=2**63, max_side_px=None) as image:
            return image.size
    import cv2  # heavy import, needed only by decode checks

    flags = {1: cv2.IMREAD_COLOR, 2: cv2.IMREAD_REDUCED_COLOR_2, 4: cv2.IMREAD_REDUCED_COLOR_4,
             8: cv2.IMREAD_REDUCED_COLOR_8}[reduction]
    with _strict_decoding() as messages:
        pixels = cv2.imdecode(np.frombuffer(data, np.uint8), flags | cv2.IMREAD_IGNORE_ORIENTATION)
    if messages:
        raise ValueError(f"decoder reports corrupt data: {messages[0]}")
    if pixels is None:
        raise ValueError("no decoder reads it")
    return int(pixels.shape[1]), int(pixels.shape[0])


def check_by_decode(accepted: ProcessedImage, max_pixels: int = DEFAULT_MAX_PIXELS) -> ProcessedImage:
    """``accepted`` (a pass-through from :func:`check_without_decode`) if its JPEG
    decodes cleanly to the size its header says, else a reject saying why."""
    try:
        size = decoded_size(accepted.data) if accepted.width * accepted.height <= max_pixels else None
    except (OSError, ValueError, SyntaxError) as e:
        reason = "truncated" if "truncated" in str(e) else "corrupt"
        return ProcessedImage(reject=f"{reason} JPEG: {e}")
    if size is None:
        return ProcessedImage(reject=_too_many(accepted.width, accepted.height, max_pixels))
    if size != (accepted.width, accepted.height):
        return ProcessedImage(
            reject=f"corrupt JPEG: decodes to {size[0]}x{size[1]}, header says {accepted.width}x{accepted.height}"
        )
    return accepted


def check_without_decode(
    data: bytes, *, max_side_px: int | None = None, quality: int | None = None, max_pixels: int = DEFAULT_MAX_PIXELS
) -> ProcessedImage | None:
    """The outcome for ``data`` when headers suffice, or None when it must be decoded.

    Headers suffice to pass a valid JPEG through (``check="header"``; a decode check
    is :func:`check_by_decode`) and to reject empty or header-corrupt JPEGs and JPEGs
    over ``max_pixels`` when there is no ``max_side_px`` to shrink them to; everything
    else (including a JPEG that does not end with its end-of-image marker: truncated,
    or followed by other bytes) needs ``decode_and_reencode``.
    """
    if not data:
        return ProcessedImage(reject="empty file")
    if not data.startswith(_SOI):
        return None
    header = parse_jpeg_header(data)
    if header is None:
        if not _ends_with_eoi(data):
            return ProcessedImage(reject="truncated JPEG (ends inside its headers)")
        return ProcessedImage(reject="corrupt JPEG (no valid frame header)")
    if not _ends_with_eoi(data):
        return None  # truncated, or trailing bytes after the image: only a decode tells
    if header.width == 0 or header.height == 0:
        return ProcessedImage(reject="corrupt JPEG (zero width or height in frame header)")
    if header.width * header.height > max_pixels and max_side_px is None:
        return ProcessedImage(reject=_too_many(header.width, header.height, max_pixels))
    too_big = max_side_px is not None and max(header.width, header.height) > max_side_px
    if header.passes_through and quality is None and not too_big:
        return ProcessedImage(data, header.width, header.height)
    return None


def decode_and_reencode(
    data: bytes, *, max_side_px: int | None = None, quality: int = 95, max_pixels: int = DEFAULT_MAX_PIXELS,
    check: str = "decode",
) -> ProcessedImage:
    """Decode ``data`` fully, convert to RGB, downscale, encode as JPEG at ``quality``;
    a reject when it is over ``max_pixels`` (after a JPEG's DCT-domain downscale) or
    the decoder reports anything (with ``check`` decode, a JPEG's decoder warnings too:
    :func:`_check_decodes`)."""
    return _decode_reencode(data, max_side_px, quality, max_pixels, strict=check == "decode")


def process_image(
    data: bytes,
    *,
    max_side_px: int | None = None,
    quality: int | None = None,
    reencode_quality: int = 95,
    check: str = "decode",
    max_pixels: int = DEFAULT_MAX_PIXELS,
) -> ProcessedImage:
    """Decide what to store for the input bytes ``data``.

    Args:
        data: the file's content.
        max_side_px: downscale when the longer side exceeds this (None = never).
        quality: re-encode every image at this quality (None = pass valid JPEGs through).
        reencode_quality: quality for normalised odd files when ``quality`` is None.
        check: ``decode`` decodes a pass-through JPEG before accepting it, and checks
            the decode of a re-encoded one for decoder warnings; ``header`` checks a
            pass-through JPEG's headers and end marker only.
        max_pixels: larger images are rejected (or downscaled, with ``max_side_px``).

    Returns:
        A ProcessedImage: JPEG bytes with width/height, or a reject reason.
    """
    quick = check_without_decode(data, max_side_px=max_side_px, quality=quality, max_pixels=max_pixels)
    if quick is not None:
        return check_by_decode(quick, max_pixels) if check == "decode" and not quick.reject else quick
    return _decode_reencode(data, max_side_px, quality if quality is not None else reencode_quality, max_pixels,
                            strict=check == "decode")
