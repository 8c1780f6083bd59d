"""Message conversion: requests to specs, batches to wire bytes."""

from __future__ import annotations

import numpy as np
import pytest

from core.errors import InvalidArgument
from feeder.pipeline import AugmentKind, CropRange
from feeder.plan import LastBatch
from feeder.producer import ReadyBatch
from feeder.servicer import batch_message, encode_batch, stream_spec
from protos import feeder_pb2


@pytest.mark.parametrize("shape", [(1, 16, 16, 3), (5, 37, 37, 3), (3, 224, 224, 3)])
def test_encoded_batch_parses_as_the_protobuf_message(shape):
    rng = np.random.default_rng(0)
    batch = ReadyBatch(
        epoch=3, cursor=17, samples_per_rank=40, keys=[f"k{i}" for i in range(shape[0])],
        labels=rng.integers(0, 1000, shape[0]), images=rng.integers(0, 256, shape, dtype=np.uint8),
        padding=np.arange(shape[0]) % 2 == 0,
    )
    parsed = feeder_pb2.Batch.FromString(encode_batch(batch))
    assert parsed == batch_message(batch)
    pixels = np.frombuffer(parsed.images, dtype=np.uint8).reshape(tuple(parsed.shape))
    assert np.array_equal(pixels, batch.images)


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
