"""Synthetic inputs of every kind the sharder must handle, made with Pillow."""

from __future__ import annotations

import io
import os
from pathlib import Path

import numpy as np
import pytest
from PIL import Image


def _pixels(seed: int, width: int = 40, height: int = 30) -> np.ndarray:
    rng = np.random.default_rng(seed)
    gradient = np.linspace(0, 255, width * height, dtype=np.float32).reshape(height, width)
    return np.clip(gradient[..., None] + rng.normal(0, 20, (height, width, 3)), 0, 255).astype(np.uint8)


def encode(image: Image.Image, fmt: str, **options: object) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format=fmt, **options)
    return buffer.getvalue()


def rgb_jpeg(seed: int = 0, **options: object) -> bytes:
    return encode(Image.fromarray(_pixels(seed)), "JPEG", quality=90, **options)


# name -> (bytes, expected outcome): "pass" (stored byte for byte), "reencode", or "reject"
def odd_inputs() -> dict[str, tuple[bytes, str]]:
    rgb = Image.fromarray(_pixels(1))
    good = rgb_jpeg(2)
    sixteen = Image.fromarray(_pixels(3)[..., 0].astype(np.uint16) * 257)  # mode I;16
    return {
        "rgb.JPEG": (rgb_jpeg(0), "pass"),
        "gray.jpg": (encode(rgb.convert("L"), "JPEG", quality=90), "pass"),
        "progressive.jpeg": (rgb_jpeg(4, progressive=True), "pass"),
        "padded_after_eoi.jpg": (good + b"\0\0", "pass"),
        "trailing_bytes.jpg": (good + b"camera maker notes", "reencode"),
        "cmyk.JPEG": (encode(rgb.convert("CMYK"), "JPEG", quality=90), "reencode"),
        "png_disguised.JPEG": (encode(rgb, "PNG"), "reencode"),
        "rgba.png": (encode(rgb.convert("RGBA"), "PNG"), "reencode"),
        "palette.png": (encode(rgb.convert("P"), "PNG"), "reencode"),
        "sixteen_bit.png": (encode(sixteen, "PNG"), "reencode"),
        "bitmap.bmp": (encode(rgb, "BMP"), "reencode"),
        "photo.webp": (encode(rgb, "WEBP"), "reencode"),
        "truncated.JPEG": (good[: len(good) // 2], "reject"),
        "empty.jpg": (b"", "reject"),
        "text.jpg": (b"this is not an image\n" * 10, "reject"),
        "random.png": (np.random.default_rng(5).bytes(2000), "reject"),
        "bad_header.jpg": (b"\xff\xd8\xff\xe0\x00\x02garbage" + good[-2:], "reject"),
        "truncated_png.png": (encode(rgb, "PNG")[:200], "reject"),
    }


def write_tree(root: Path, classes: dict[str, dict[str, bytes]]) -> Path:
    """Write ``{class: {file name: bytes}}`` as a class-folder tree under ``root``."""
    for name, files in classes.items():
        for file_name, data in files.items():
            path = root / name / file_name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)
    return root


def corrupt_scan_jpeg(seed: int = 0) -> bytes:
    """A JPEG with valid headers and end marker whose entropy-coded data is garbage
    (decoders only warn, then fill the rest with grey)."""
    good = encode(Image.fromarray(np.tile(_pixels(seed), (4, 4, 1))), "JPEG", quality=90)
    sos = good.index(b"\xff\xda")
    start = sos + 2 + int.from_bytes(good[sos + 2 : sos + 4], "big")
    count = (len(good) - 2 - start) // 2
    junk = np.random.default_rng(seed).integers(0, 255, count, dtype=np.uint8)
    junk[junk == 0xFF] = 0x7F  # no byte that could start a marker
    return good[: start + count // 2] + junk.tobytes() + good[start + count // 2 + count :]


def huge_jpeg(side: int = 20000) -> bytes:
    """A valid ``side`` x ``side`` grey JPEG: a decompression bomb of a few MB."""
    return encode(Image.new("L", (side, side), 128), "JPEG", quality=10)


def forged_size_jpeg(side: int = 65000) -> bytes:
    """A small JPEG whose frame header claims ``side`` x ``side``: far fewer bytes of
    image data than the size needs (decoders warn, then fill the rest with grey)."""
    data = bytearray(rgb_jpeg(7))
    frame = data.index(b"\xff\xc0")
    data[frame + 5 : frame + 9] = side.to_bytes(2, "big") * 2  # height, width
    return bytes(data)


def make_unlistable(monkeypatch: pytest.MonkeyPatch, folder: Path) -> None:
    """Listing ``folder`` fails with EACCES, as it would for a user without read
    permission. Tests run as root, for whom ``chmod 000`` does not stop a listing, so
    ``os.scandir`` (which ``os.walk`` uses too) is made to fail for that one path."""
    real = os.scandir

    def scandir(path: object = ".") -> object:
        if isinstance(path, (str, os.PathLike)) and os.fspath(path) == str(folder):
            raise PermissionError(13, "Permission denied", str(folder))
        return real(path)  # type: ignore[call-overload]

    monkeypatch.setattr(os, "scandir", scandir)
