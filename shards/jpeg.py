"""JPEGs for fast windows, with libjpeg-turbo: crop windows decoded alone, a batch at
a time on a few threads (the CPU pipeline's decode stage, :mod:`decode.pipeline`), and
restart markers that let a window skip the entropy decoding around it (written by
``feeder shard``).

A window is decoded alone: rows above it are only entropy-decoded, decoding stops
after its last row, and columns outside it are cropped before the IDCT, upsampling
and colour conversion (``_jpeg.c``). Its pixels are exactly those of a full decode
(tests/shards/test_jpeg.py). Where the window is at least twice the output on both
sides it is decoded at a reduced DCT scale (1/2, 1/4 or 1/8, libjpeg-turbo's SIMD
ones), still at least the output's size: the resize after it then starts from fewer
pixels, and the IDCT's scaling is an averaging filter, no aliasing added.

Entropy (Huffman) decoding is sequential: without help, the rows above a window and
the columns beside it are still entropy-decoded, which is most of the work.
:func:`add_restarts` rewrites a JPEG losslessly (same DCT coefficients, same pixels;
optimised Huffman tables) with a restart marker every few MCUs, so that restart
intervals tile each MCU row; a window of such a JPEG is then cut out, as the
intervals around it, into a smaller JPEG of its own before decoding, and only about
its own area is entropy-decoded. Any JPEG decoder reads these files as before.

Measured on one core of the reference machine (sample data, RandomResizedCrop
windows averaging 253x254 px of 399x398 px images): DALI's CPU
``decoders.image_slice`` 0.43 ms per window; here 0.32 ms, and 0.25 ms on JPEGs with
restart markers every 2 MCUs (1.5 % larger files); a full decode 0.44 ms.

The C part is a plain shared library built with the package (``setup.py``, against
the system's libjpeg-turbo) and called through ctypes, which releases the GIL for the
call. Where it was not built, :func:`available` says why; the pipeline then decodes
with DALI and the sharder writes JPEGs as they come. A JPEG whose colours libjpeg-turbo
does not convert to RGB (CMYK, YCCK) is decoded whole by OpenCV and cropped; any other
failure (truncated data included) is reported, never patched up.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path

import cv2
import numpy as np

from core.native import load_library
from core.workers import Lane, Loop

__all__ = [
    "DEFAULT_RESTART_INTERVAL", "BatchDecode", "JpegError", "WindowDecodeError", "WindowDecoder", "add_restarts",
    "available", "dct_denominator", "decode_window", "tiling_interval", "unavailable_reason",
]

# MCUs per restart interval that add_restarts aims at (the largest divisor of a row's
# MCUs up to it): 2 (32 px of 4:2:0) measured fastest on the sample data, for 1.5 %
# more bytes; 1 gives 2.6 %, 4 0.6 % and slightly slower windows.
DEFAULT_RESTART_INTERVAL = 2

_OK, _TOO_SMALL = 0, -2  # feeder_jpeg_decode_window's codes; -1 is a failure
# What it reports in info[]: rows, row width, the window's left column in a row, its
# width (all at the decode scale), and the bytes needed when the buffer was too small.
_INFO_LEN, _NEEDED = 5, 4
_ERROR_BYTES = 256  # libjpeg's JMSG_LENGTH_MAX is 200
_CONVERSION = "Unsupported color conversion"  # libjpeg's JERR_CONVERSION_NOTIMPL
_DENOMINATORS = (8, 4, 2)  # the reduced scales libjpeg-turbo has SIMD IDCTs for
# Columns a decoded row may hold beyond the window: an iMCU column of margin on each
# side (at most 4 x 8 pixels) and the alignment of the region's start.
_SLACK_COLS = 96


@cache
def _library() -> ctypes.CDLL | str:
    """The built C library, or why there is none."""
    return load_library(Path(__file__).resolve().parent, "_jpeg", _declare,
                        needs="a C compiler and libjpeg-turbo's headers (e.g. libjpeg62-turbo-dev) are present")


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    """Declare the C functions' signatures (ctypes checks the arguments by them)."""
    fn = lib.feeder_jpeg_decode_window
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
        ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int,
    ]
    fn = lib.feeder_jpeg_add_restarts
    fn.restype = ctypes.c_int
    fn.argtypes = [
        ctypes.c_char_p, ctypes.c_size_t, ctypes.c_int, ctypes.POINTER(ctypes.c_void_p),
        ctypes.POINTER(ctypes.c_ulong), ctypes.POINTER(ctypes.c_int), ctypes.c_char_p, ctypes.c_int,
    ]
    lib.feeder_jpeg_tiling_interval.restype = ctypes.c_int
    lib.feeder_jpeg_tiling_interval.argtypes = [ctypes.c_int, ctypes.c_int]
    lib.feeder_jpeg_free.restype = None
    lib.feeder_jpeg_free.argtypes = [ctypes.c_void_p]
    return lib


def available() -> bool:
    """Whether windows can be decoded here (the C library was built and loads)."""
    return not isinstance(_library(), str)


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    lib = _library()
    return lib if isinstance(lib, str) else None


def dct_denominator(width: int, height: int, size: int) -> int:
    """The largest DCT scale denominator (8, 4, 2, else 1) that keeps a ``width x
    height`` window at least ``size`` on both sides: 2 or more only where the window
    is at least twice the output."""
    for d in _DENOMINATORS:
        if width >= d * size and height >= d * size:
            return d
    return 1


def tiling_interval(mcus_per_row: int, interval: int) -> int:
    """The restart interval :func:`add_restarts` writes for rows of ``mcus_per_row``
    MCUs when asked for ``interval``: the largest divisor of the row's length up to it,
    so that restart intervals tile the rows (what :func:`decode_window` cuts by)."""
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    return int(lib.feeder_jpeg_tiling_interval(mcus_per_row, interval))


class JpegError(Exception):
    """libjpeg-turbo could not read a JPEG; the message says why."""


class WindowDecodeError(JpegError):
    """A sample could not be decoded (the message is libjpeg-turbo's reason)."""


def add_restarts(data: bytes, interval: int = DEFAULT_RESTART_INTERVAL, strict: bool = False) -> bytes:
    """The same JPEG (the same DCT coefficients, so the same pixels for every
    decoder), rewritten as a sequential Huffman JPEG with optimised tables and a
    restart marker every ``k`` MCUs, ``k`` the largest divisor of an MCU row's length
    up to ``interval``: restart intervals then tile the rows, and windows decode
    about only their own area (:func:`decode_window`). APPn and COM markers are kept.

    Reading every coefficient entropy-decodes the whole image: with ``strict`` any
    corrupt-data warning of libjpeg's on the way (a bad Huffman code, extraneous
    bytes, a data segment ending early: what a decoder only warns about, filling the
    rest with grey) is an error too, so the rewrite doubles as a decode check.

    Raises:
        JpegError: ``data`` is not a JPEG libjpeg-turbo reads whole (truncated ones
            included), or, with ``strict``, one it warned about.
    """
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    if interval < 1:
        raise ValueError(f"interval: {interval} MCUs; must be >= 1")
    out, size, warnings = ctypes.c_void_p(), ctypes.c_ulong(), ctypes.c_int()
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    if lib.feeder_jpeg_add_restarts(data, len(data), interval, ctypes.byref(out), ctypes.byref(size),
                                    ctypes.byref(warnings), error, _ERROR_BYTES) != _OK:
        raise JpegError(error.value.decode(errors="replace") or "not a JPEG")
    try:
        if strict and warnings.value:
            raise JpegError(f"decoder reports corrupt data: {error.value.decode(errors='replace')}")
        return ctypes.string_at(out, size.value)
    finally:
        lib.feeder_jpeg_free(out)


def decode_window(data: np.ndarray, box: Sequence[int], denominator: int = 1,
                  scratch: np.ndarray | None = None) -> np.ndarray:
    """Decode one window of a JPEG.

    Args:
        data: the encoded JPEG, uint8, C-contiguous.
        box: x, y, width, height of the window in the image's pixels.
        denominator: DCT scale 1/``denominator`` (1, 2, 4 or 8).
        scratch: uint8 buffer to decode into when large enough (else a new one).

    Returns:
        uint8 ``[h, w, 3]`` RGB, a view into ``scratch`` (or the new buffer), rows
        possibly strided: the window at scale 1/``denominator``.

    Raises:
        WindowDecodeError: libjpeg-turbo cannot decode the sample (nor OpenCV, for
            colour spaces only it converts).
    """
    lib = _library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    x, y, w, h = (int(v) for v in box)
    if scratch is None or scratch.size < _capacity(w, h, denominator):
        scratch = np.empty(_capacity(w, h, denominator), dtype=np.uint8)
    info = np.zeros(_INFO_LEN, dtype=np.intc)
    error = ctypes.create_string_buffer(_ERROR_BYTES)
    address = data.ctypes.data
    for _ in range(2):
        code = lib.feeder_jpeg_decode_window(
            address, data.size, x, y, w, h, denominator, scratch.ctypes.data, scratch.size,
            info.ctypes.data, error, _ERROR_BYTES)
        if code != _TOO_SMALL:
            break
        scratch = np.empty(int(info[_NEEDED]), dtype=np.uint8)
    if code != _OK:
        reason = error.value.decode(errors="replace") or "failed"
        if _CONVERSION in reason:  # CMYK or YCCK: OpenCV converts those to RGB
            return _decode_whole(data, (x, y, w, h), reason)
        raise WindowDecodeError(reason)
    rows, row_width, left, cols = (int(v) for v in info[:4])
    region = scratch[: rows * row_width * 3].reshape(rows, row_width, 3)
    return region[:, left : left + cols]


def _capacity(width: int, height: int, denominator: int) -> int:
    return (-(-height // denominator) + 1) * (-(-width // denominator) + _SLACK_COLS) * 3


def _decode_whole(data: np.ndarray, box: tuple[int, int, int, int], reason: str) -> np.ndarray:
    """The window of a full OpenCV decode (colour spaces libjpeg-turbo does not
    convert to RGB, such as CMYK), at full scale."""
    image = cv2.imdecode(data, cv2.IMREAD_COLOR)
    if image is None:
        raise WindowDecodeError(reason)
    x, y, w, h = box
    window = image[max(0, y) : y + h, max(0, x) : x + w]
    if window.size == 0:
        raise WindowDecodeError(f"window {box} outside the {image.shape[1]}x{image.shape[0]} image")
    return cv2.cvtColor(window, cv2.COLOR_BGR2RGB)


@dataclass
class BatchDecode:
    """One batch's windows being decoded; :meth:`result` waits for them."""

    windows: list[np.ndarray | None]
    errors: dict[int, str] = field(default_factory=dict)
    loop: Loop | None = None
    arena: list[np.ndarray] | None = None  # the buffers the windows are in (None: their own)

    def result(self) -> tuple[list[np.ndarray], dict[int, str]]:
        """The windows (in batch order) and the failures (position -> reason); a
        failed position's window is an empty array."""
        if self.loop is not None:
            self.loop.wait()
        empty = np.empty((0, 0, 3), dtype=np.uint8)
        return [w if w is not None else empty for w in self.windows], dict(sorted(self.errors.items()))


class WindowDecoder:
    """Decodes batches of windows on the workers of ``lane`` (a lane of a pool shared
    with other decoders: see :mod:`core.workers`), each worker taking the next sample
    when it is free (samples differ in cost), into buffers reused from batch to batch.

    A batch's buffers are its arena's, taken when it is submitted and given back by
    :meth:`recycle` once its windows have been used: however many batches are in
    flight (the number may change from batch to batch), none shares buffers with
    another.

    Args:
        lane: where the work runs.
        arenas: arenas kept for reuse (batches' buffers given back beyond these are
            dropped).
    """

    def __init__(self, lane: Lane, arenas: int) -> None:
        if not available():
            raise RuntimeError(unavailable_reason())
        self._lane = lane
        self._keep = max(1, arenas)
        self._free: list[list[np.ndarray]] = []
        self._lock = threading.Lock()

    def submit(self, jpegs: Sequence[np.ndarray], boxes: np.ndarray, denominators: np.ndarray,
               positions: Sequence[int] | None = None, own_buffers: bool = False) -> BatchDecode:
        """Start decoding ``jpegs[i]``'s window ``boxes[i]`` at 1/``denominators[i]``,
        for each ``i`` in ``positions`` (None: every one), into an arena's buffers
        (``own_buffers``: into buffers of their own, for windows decoded ahead of
        their batch)."""
        n = len(jpegs)
        arena: list[np.ndarray] | None = None
        if not own_buffers:
            with self._lock:
                arena = self._free.pop() if self._free else []
            arena.extend(np.empty(0, dtype=np.uint8) for _ in range(n - len(arena)))
        batch = BatchDecode(windows=[None] * n, arena=arena)
        todo = list(range(n)) if positions is None else list(positions)

        def work(k: int) -> None:
            i = todo[k]
            box = boxes[i]
            d = int(denominators[i])
            scratch = None
            if arena is not None:
                need = _capacity(int(box[2]), int(box[3]), d)
                if arena[i].size < need:
                    arena[i] = np.empty(need + need // 4, dtype=np.uint8)
                scratch = arena[i]
            try:
                batch.windows[i] = decode_window(jpegs[i], box, d, scratch)
            except WindowDecodeError as e:
                batch.errors[i] = str(e)

        batch.loop = self._lane.parallel(work, len(todo))
        return batch

    def recycle(self, batch: BatchDecode) -> None:
        """``batch``'s windows are no longer used: its arena may be reused."""
        arena, batch.arena = batch.arena, None
        if arena is not None:
            with self._lock:
                if len(self._free) < self._keep:
                    self._free.append(arena)

    def release_buffers(self) -> None:
        """Drop the buffers kept for the next batches."""
        with self._lock:
            self._free = []
