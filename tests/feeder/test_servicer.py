"""Message conversion: requests to specs (batches to wire bytes: tests/transport)."""

from __future__ import annotations

import pytest

from core.errors import InvalidArgument
from feeder.pipeline import AugmentKind, CropRange
from feeder.plan import LastBatch
from feeder.servicer import stream_spec
from protos import feeder_pb2


def _request(**fields) -> feeder_pb2.StreamRequest:
    return feeder_pb2.StreamRequest(**(dict(world_size=1, batch_size=4, image_size=32) | fields))


def test_stream_spec_maps_enums_and_crop_defaults():
    spec = stream_spec(_request(
        dataset="d", split="val", last_batch=feeder_pb2.LAST_BATCH_PAD, augment=feeder_pb2.AUGMENT_TRAIN,
        min_scale=0.25,
    ))
    assert spec.last_batch is LastBatch.PAD and spec.kind is AugmentKind.TRAIN
    assert spec.crop == CropRange(min_scale=0.25)
    assert stream_spec(_request(split="train")).kind is AugmentKind.TRAIN
    assert stream_spec(_request(split="val")).kind is AugmentKind.VAL
    assert stream_spec(_request(epochs=0)).epochs == 1
    with pytest.raises(InvalidArgument, match="augment"):
        stream_spec(_request(augment=9))
