"""Caffe ``Datum`` protobuf messages, encoded by hand (no generated code needed).

From caffe/src/caffe/proto/caffe.proto::

    message Datum {
      optional int32 channels = 1;
      optional int32 height = 2;
      optional int32 width = 3;
      optional bytes data = 4;       // here: the encoded JPEG
      optional int32 label = 5;
      repeated float float_data = 6;
      optional bool encoded = 7 [default = false];
    }

Protobuf wire format: each field is a varint key ``(number << 3) | wire_type``
(0 = varint, 2 = length-delimited) followed by its value.
"""

from __future__ import annotations

__all__ = ["decode_datum", "encode_datum"]

_VARINT, _BYTES = 0, 2


def _varint(value: int) -> bytes:
    if value < 0:
        value += 1 << 64  # int32 negatives are sign-extended to 10 bytes
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, wire_type: int) -> bytes:
    return _varint(number << 3 | wire_type)


def encode_datum(jpeg: bytes, label: int, width: int, height: int) -> bytes:
    """A serialized Datum holding an encoded image and its label.

    Args:
        jpeg: the encoded image bytes.
        label: class index.
        width / height: image size in pixels (informational for readers).

    Returns:
        The protobuf wire bytes.
    """
    return b"".join(
        [
            _field(1, _VARINT) + _varint(3),
            _field(2, _VARINT) + _varint(height),
            _field(3, _VARINT) + _varint(width),
            _field(4, _BYTES) + _varint(len(jpeg)) + jpeg,
            _field(5, _VARINT) + _varint(label),
            _field(7, _VARINT) + _varint(1),
        ]
    )


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = buf[pos]
        value |= (byte & 0x7F) << shift
        pos, shift = pos + 1, shift + 7
        if not byte & 0x80:
            return value, pos


def decode_datum(buf: bytes) -> dict[int, int | bytes]:
    """Field number -> value of a serialized Datum (varint and bytes fields only).

    Raises:
        ValueError: a wire type this module does not write.
    """
    fields: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(buf):
        key, pos = _read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == _VARINT:
            fields[number], pos = _read_varint(buf, pos)
        elif wire_type == _BYTES:
            size, pos = _read_varint(buf, pos)
            fields[number], pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"Datum field {number} has unsupported wire type {wire_type}")
    return fields
