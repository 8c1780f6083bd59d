"""A batch's small fields, one record on both sides: every field of ``Batch`` that is
not about pixels is a field of ``BatchMeta``, and each survives the wire both ways,
through every transport's message."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from protocol.batch import PIXEL_FIELDS, BatchMeta, from_message, to_message
from protos import feeder_pb2
from transport.base import TransportConfig
from transport.grpc_payload import GrpcPayloadSender, parse_batch
from transport.shm import ShmSender, instance_prefix

_WIRE = set(feeder_pb2.Batch.DESCRIPTOR.fields_by_name) - PIXEL_FIELDS
_META = {f.name for f in dataclasses.fields(BatchMeta)}


def _meta() -> BatchMeta:
    """Every field set to something other than its default."""
    return BatchMeta(epoch=3, cursor=17, samples_per_rank=40, keys=["a", "b", "c"],
                     labels=np.array([5, -1, 2**40], dtype=np.int64), padding=np.array([False, True, True]),
                     failed_keys=["x", "y"])


def _equal(a: BatchMeta, b: BatchMeta) -> bool:
    return all(np.array_equal(getattr(a, n), getattr(b, n)) and type(getattr(a, n)) is type(getattr(b, n))
               for n in _META)


def test_the_record_and_the_message_have_the_same_fields():
    assert _META == _WIRE
    for field in dataclasses.fields(BatchMeta):
        assert field.default is dataclasses.MISSING or not getattr(_meta(), field.name) == field.default


def test_every_field_survives_the_message():
    meta = _meta()
    assert _equal(from_message(feeder_pb2.Batch.FromString(to_message(meta, (3, 2, 2, 3)).SerializeToString())),
                  meta)


def test_arrays_come_back_with_their_dtypes():
    back = from_message(to_message(_meta(), (3, 2, 2, 3)))
    assert back.labels.dtype == np.int64 and back.padding.dtype == np.bool_


@pytest.mark.parametrize("transport", ["grpc", "shm"])
def test_every_field_survives_each_transport(transport, tmp_path):
    config = TransportConfig(shm_dir=tmp_path, ring_slots=2)
    sender = GrpcPayloadSender("s") if transport == "grpc" else ShmSender(instance_prefix() + "1", config, 36)
    try:
        slot = sender.slot_for((3, 2, 2, 3))
        slot.array[:] = np.arange(36, dtype=np.uint8).reshape(3, 2, 2, 3)
        wire = parse_batch(sender.message(slot, _meta()))
        assert _equal(from_message(wire.message), _meta())
    finally:
        sender.close()
