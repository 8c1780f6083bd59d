"""Protocol-buffer wire format helpers, for messages encoded by hand (Caffe ``Datum``
in the LMDB shards) or partly by hand (a ``Batch`` whose pixels are appended without
an intermediate copy).

Wire format: each field is a varint key ``(number << 3) | wire_type`` followed by its
value; wire type 0 is a varint, 2 a length-delimited byte string.
"""

from __future__ import annotations

__all__ = ["BYTES", "VARINT", "field_key", "read_varint", "varint"]

VARINT, BYTES = 0, 2


def varint(value: int) -> bytes:
    """``value`` as a base-128 varint; negatives as 64-bit two's complement (10 bytes),
    as protobuf encodes negative int32/int64."""
    if value < 0:
        value += 1 << 64
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def field_key(number: int, wire_type: int) -> bytes:
    """The encoded key of field ``number`` with ``wire_type``."""
    return varint(number << 3 | wire_type)


def read_varint(buf: bytes | memoryview, pos: int) -> tuple[int, int]:
    """The varint starting at ``buf[pos]`` and the position after it.

    Raises:
        IndexError: the buffer ends inside the varint.
    """
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos
