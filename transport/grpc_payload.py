"""The gRPC payload: pixels inside each ``Batch`` message, for clients on other
hosts (and as the fallback of the same-host transports).

Daemon half, :class:`GrpcPayloadSender`: the producer writes the pixels straight
into the bytes object that becomes the message; the small fields are serialized by
protobuf into room reserved in front of them. Client half, :func:`parse_batch` (a
raw ``response_deserializer``) and :class:`InlineReceiver`: protobuf parses the
small fields only; the pixels stay where gRPC put them and the tensor is a view.

Copies of the pixels between DALI's output and the client's tensor (grpcio 1.85):

1. daemon, producer: DALI's output -> the message's bytes (``slot_for``);
2. daemon, grpc: bytes -> a grpc slice (``SendMessageOperation``,
   ``grpc_slice_from_copied_buffer``; it requires ``bytes``);
3. kernel: the socket send (on loopback, one copy covers send and receive);
4. kernel -> grpc's receive slices (``recv``);
5. client, grpc: each slice -> a ``bytes`` chunk (``ReceiveMessageOperation``);
6. client, grpc: ``b"".join(chunks)`` -> the bytes handed to the deserializer;
   then no copy: ``parse_batch`` and ``InlineReceiver`` take a view of it.

So 5 copies in user space and the kernel's, against about 10 before (``as_array``,
the join into the message, protobuf's parse and field access, the host tensor).
2, 5 and 6 are inside grpcio's Cython layer: grpc's "Python zero copy"
experiment (later releases) drops 2 and turns 5+6 into one. Reaching 4 needs that.
"""

from __future__ import annotations

import ctypes
import math
from dataclasses import dataclass

import numpy as np

from core.errors import DataError, InvalidArgument
from core.wire import read_varint, varint
from protocol.batch import BatchMeta, to_message
from protos import feeder_pb2
from transport.base import (
    BatchReceiver,
    BatchSender,
    ReceivedBatch,
    Slot,
    TransportKind,
    WireBatch,
    check_shape,
    host_tensor,
    wrap_memory,
)
from transport.heap import fit_messages

__all__ = ["GrpcPayloadSender", "InlineReceiver", "parse_batch"]

_FIELDS = feeder_pb2.Batch.DESCRIPTOR.fields_by_name
_IMAGES = _FIELDS["images"].number
_FILLER = _FIELDS["filler"].number
_LENGTH_DELIMITED = 2


def _read_varint(data: bytes, pos: int) -> tuple[int, int]:
    try:
        value, end = read_varint(data, pos)
    except IndexError:
        raise DataError(f"Batch message: bad varint at byte {pos}") from None
    if end - pos > 10:  # more than a 64-bit value needs
        raise DataError(f"Batch message: bad varint at byte {pos}")
    return value, end


_IMAGES_KEY = varint(_IMAGES << 3 | _LENGTH_DELIMITED)
_FILLER_KEY = varint(_FILLER << 3 | _LENGTH_DELIMITED)

# A bytes object the producer may fill before anyone else sees it. The C API leaves
# the contents of PyBytes_FromStringAndSize(NULL, n) for its creator to write (grpc
# builds its received messages the same way); the object is not hashed or shared
# until ``message()`` returns it. Its data start at a fixed offset (CPython layout).
_new_bytes = ctypes.pythonapi.PyBytes_FromStringAndSize
_new_bytes.restype = ctypes.py_object
_new_bytes.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t)
_BYTES_DATA_OFFSET = bytes.__basicsize__ - 1  # offsetof(PyBytesObject, ob_sval)


def _bytes_array(data: bytes | bytearray, offset: int = 0, nbytes: int | None = None) -> np.ndarray:
    """A writable uint8 view of ``data[offset:offset + nbytes]``, keeping it alive.

    Only for bytes objects nothing else refers to: a message being built, or one
    that gRPC handed to the deserializer and dropped.
    """
    nbytes = len(data) - offset if nbytes is None else nbytes
    if offset < 0 or offset + nbytes > len(data):
        raise ValueError(f"{offset}+{nbytes} outside {len(data)} bytes")
    if type(data) is not bytes:  # a bytearray (tests, other callers): its own view
        return np.frombuffer(data, dtype=np.uint8, count=nbytes, offset=offset)
    return wrap_memory(id(data) + _BYTES_DATA_OFFSET + offset, nbytes, owner=data)


def _filler(room: int) -> bytes | None:
    """``filler`` fields exactly ``room`` bytes long (b"" for 0; None for 1).

    One field where its length's varint allows; otherwise an empty one first (a
    repeated singular field is valid wire format: the last one wins).
    """
    if room == 0:
        return b""
    for varint_len in range(1, 6):
        length = room - len(_FILLER_KEY) - varint_len
        if length >= 0 and len(varint(length)) == varint_len:
            return _FILLER_KEY + varint(length) + bytes(length)
    empty = _FILLER_KEY + varint(0)
    rest = _filler(room - len(empty)) if room > len(empty) else None
    return None if rest is None else empty + rest


@dataclass(frozen=True)
class _Message:
    """A message being built: its bytes and a writable view of all of them."""

    data: bytes
    whole: np.ndarray


class GrpcPayloadSender(BatchSender):
    """Daemon half: each batch becomes one bytes object, written once.

    Layout: ``[small fields][filler][images key, length][pixels]``; the pixels'
    place is known from the shape alone, so the producer fills it before the small
    fields are serialized into the room in front (``head_reserve_bytes``).

    Args:
        stream_id: The daemon's name for the stream (for messages).
        head_reserve_bytes: Room for the small fields; a larger head costs a copy.
    """

    kind = TransportKind.GRPC

    def __init__(self, stream_id: str = "", head_reserve_bytes: int = 64 << 10) -> None:
        if head_reserve_bytes < 2:
            raise ValueError(f"head_reserve_bytes must be >= 2, got {head_reserve_bytes}")
        self.stream_id = stream_id
        self._reserve = head_reserve_bytes
        self.joined_messages = 0  # messages whose head did not fit (one more copy)

    def slot_for(self, shape: tuple[int, ...]) -> Slot:
        nbytes = math.prod(shape)
        prefix = _IMAGES_KEY + varint(nbytes)
        start = self._reserve + len(prefix)
        fit_messages(start + nbytes)  # above 32 MiB: keep them on malloc's heap (transport.heap)
        data = _new_bytes(None, start + nbytes)  # >= 4 bytes: never a shared singleton
        whole = _bytes_array(data)
        whole[self._reserve:start] = np.frombuffer(prefix, dtype=np.uint8)
        pixels = whole[start:].reshape(shape)
        return Slot(pixels=pixels, keep=_Message(data, whole))

    def message(self, slot: Slot, meta: BatchMeta) -> bytes:
        if not isinstance(slot.keep, _Message):
            raise TypeError("slot was not lent by this sender")
        data, whole = slot.keep.data, slot.keep.whole
        head = to_message(meta, slot.shape).SerializeToString()
        filler = _filler(self._reserve - len(head))
        if filler is None:  # head too large for the room: pay one copy
            self.joined_messages += 1
            return b"".join((head, memoryview(data)[self._reserve:]))
        whole[: self._reserve] = np.frombuffer(head + filler, dtype=np.uint8)
        return data

    def release(self, index: int, generation: int) -> None:
        raise InvalidArgument(
            f"stream {self.stream_id or '?'} sends pixels inline: no slot {index} to release"
        )

    def close(self) -> None:
        pass  # nothing is held between messages


def parse_batch(data: bytes) -> WireBatch:
    """A serialized ``Batch`` with its pixels left in place (a raw response
    deserializer: ``channel.unary_stream(..., response_deserializer=parse_batch)``;
    or call it on raw bytes to keep its errors typed).

    Walks the top-level fields, cuts out ``images`` (the last one wins, as in
    protobuf) and ``filler``, and lets protobuf parse the rest: only the small
    fields are copied.

    Raises:
        DataError: bytes that are not a well-formed message.
    """
    view = memoryview(data)
    pieces: list[memoryview] = []
    pixels_at = (-1, 0)
    pos = run_start = 0
    while pos < len(data):
        field_start = pos
        key, pos = _read_varint(data, pos)
        number, wire_type = key >> 3, key & 7
        value_start = pos
        pos = _skip_value(data, pos, wire_type)
        if wire_type == _LENGTH_DELIMITED and number in (_IMAGES, _FILLER):
            pieces.append(view[run_start:field_start])
            run_start = pos
            if number == _IMAGES:
                start = _read_varint(data, value_start)[1]
                pixels_at = (start, pos - start)
    pieces.append(view[run_start:])
    try:
        message = feeder_pb2.Batch.FromString(b"".join(pieces))
    except Exception as e:  # noqa: BLE001 - protobuf's DecodeError and friends
        raise DataError(f"Batch message: {e}") from e
    return WireBatch(message=message, data=data, pixels_offset=pixels_at[0], pixels_nbytes=pixels_at[1])


def _skip_value(data: bytes, pos: int, wire_type: int) -> int:
    if wire_type == 0:
        return _read_varint(data, pos)[1]
    if wire_type == _LENGTH_DELIMITED:
        length, pos = _read_varint(data, pos)
        end = pos + length
    elif wire_type in (1, 5):
        end = pos + (8 if wire_type == 1 else 4)
    else:
        raise DataError(f"Batch message: wire type {wire_type} at byte {pos}")
    if end > len(data):
        raise DataError(f"Batch message: field runs past the end ({end} > {len(data)} bytes)")
    return end


class InlineReceiver(BatchReceiver):
    """Client half: the tensor is a view of the received bytes.

    gRPC hands the deserializer a fresh bytes object and keeps no reference to it,
    so the batch is that object's only user: the view is made writable (as a
    ``torch.frombuffer`` of bytes would be, minus the warning) and keeps the bytes
    alive. Writing to it changes only this batch.
    """

    def receive(self, wire: WireBatch) -> ReceivedBatch:
        if wire.pixels_offset < 0:
            raise DataError("batch without pixels and without a slot")
        shape = tuple(wire.message.shape)
        check_shape(shape, wire.pixels_nbytes)
        fit_messages(len(wire.data))  # the next ones: gRPC allocates them as this one
        array = _bytes_array(wire.data, wire.pixels_offset, wire.pixels_nbytes).reshape(shape)
        return ReceivedBatch(images=host_tensor(array), message=wire.message)

