"""Turn one input file into the JPEG bytes that go into a shard, or a reject reason.

Valid baseline or progressive 8-bit JPEGs (RGB/YCbCr or grayscale) pass through byte
for byte: only their headers are parsed and the end-of-image marker checked, no
decode. Everything else that Pillow can fully decode (CMYK JPEG, PNG even when named
``.JPEG``, RGBA, palette, 16-bit, BMP, WebP, ...) is normalised to an RGB JPEG. The
format is read from the content, never from the file name.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, UnidentifiedImageError

__all__ = [
    "JpegHeader",
    "ProcessedImage",
    "check_without_decode",
    "decode_and_reencode",
    "parse_jpeg_header",
    "process_image",
    "read_input",
]

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


def _decode_reencode(data: bytes, max_side_px: int | None, quality: int) -> ProcessedImage:
    try:
        with Image.open(io.BytesIO(data)) as image:
            if max_side_px is not None and image.format == "JPEG":
                image.draft(image.mode, (max_side_px, max_side_px))  # DCT-domain downscale
            image.load()
            rgb = _shrunk(_to_rgb(image), max_side_px)
    except UnidentifiedImageError:
        return ProcessedImage(reject="not an image (content is no known image format)")
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        reason = "truncated" if "truncated" in str(e) else "corrupt"
        return ProcessedImage(reject=f"{reason} image: {e}")
    return ProcessedImage(_encode_rgb(rgb, quality), rgb.width, rgb.height, reencoded=True)


def check_without_decode(data: bytes, *, max_side_px: int | None = None, quality: int | None = None) -> ProcessedImage | None:
    """The outcome for ``data`` when headers suffice, or None when it must be decoded.

    Headers suffice to pass a valid JPEG through and to reject empty or header-corrupt
    JPEGs; everything else (including a JPEG that does not end with its end-of-image
    marker: truncated, or followed by other bytes) needs ``decode_and_reencode``.
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
    too_big = max_side_px is not None and max(header.width, header.height) > max_side_px
    if header.passes_through and quality is None and not too_big:
        return ProcessedImage(data, header.width, header.height)
    return None


def decode_and_reencode(data: bytes, *, max_side_px: int | None = None, quality: int = 95) -> ProcessedImage:
    """Decode ``data`` fully, convert to RGB, downscale, encode as JPEG at ``quality``."""
    return _decode_reencode(data, max_side_px, quality)


def process_image(
    data: bytes, *, max_side_px: int | None = None, quality: int | None = None, reencode_quality: int = 95
) -> ProcessedImage:
    """Decide what to store for the input bytes ``data``.

    Args:
        data: the file's content.
        max_side_px: downscale when the longer side exceeds this (None = never).
        quality: re-encode every image at this quality (None = pass valid JPEGs through).
        reencode_quality: quality for normalised odd files when ``quality`` is None.

    Returns:
        A ProcessedImage: JPEG bytes with width/height, or a reject reason.
    """
    quick = check_without_decode(data, max_side_px=max_side_px, quality=quality)
    if quick is not None:
        return quick
    return _decode_reencode(data, max_side_px, quality if quality is not None else reencode_quality)


def read_input(path: Path) -> bytes | ProcessedImage:
    """The content of ``path``, or a reject when it cannot be read."""
    try:
        return path.read_bytes()
    except OSError as e:
        return ProcessedImage(reject=f"unreadable: {e.strerror or e}")
