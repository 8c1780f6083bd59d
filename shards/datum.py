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

The wire format helpers are :mod:`core.wire`.
"""

from __future__ import annotations

from core.wire import BYTES, VARINT, field_key, read_varint, varint

__all__ = ["decode_datum", "encode_datum"]


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
            field_key(1, VARINT) + varint(3),
            field_key(2, VARINT) + varint(height),
            field_key(3, VARINT) + varint(width),
            field_key(4, BYTES) + varint(len(jpeg)) + jpeg,
            field_key(5, VARINT) + varint(label),
            field_key(7, VARINT) + varint(1),
        ]
    )


def decode_datum(buf: bytes) -> dict[int, int | bytes]:
    """Field number -> value of a serialized Datum (varint and bytes fields only).

    Raises:
        ValueError: a wire type this module does not write.
    """
    fields: dict[int, int | bytes] = {}
    pos = 0
    while pos < len(buf):
        key, pos = read_varint(buf, pos)
        number, wire_type = key >> 3, key & 7
        if wire_type == VARINT:
            fields[number], pos = read_varint(buf, pos)
        elif wire_type == BYTES:
            size, pos = read_varint(buf, pos)
            fields[number], pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"Datum field {number} has unsupported wire type {wire_type}")
    return fields
