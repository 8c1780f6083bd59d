from __future__ import annotations

from concurrent import futures

import grpc
import numpy as np
import pytest
import torch

from core.errors import DataError, InvalidArgument
from protos import feeder_pb2
from tests.transport.conftest import make_batch
from transport.grpc_payload import GrpcPayloadSender, InlineReceiver, _filler, parse_batch


def _send(sender: GrpcPayloadSender, pixels: np.ndarray, meta) -> bytes:
    slot = sender.slot_for(pixels.shape)
    np.copyto(slot.array, pixels)
    return sender.message(slot, meta)


def test_message_is_an_ordinary_batch():
    pixels, meta = make_batch()
    data = _send(GrpcPayloadSender(head_reserve_bytes=1024), pixels, meta)
    message = feeder_pb2.Batch.FromString(data)
    assert message.images == pixels.tobytes()
    assert list(message.shape) == list(pixels.shape)
    assert list(message.keys) == meta.keys
    assert list(message.labels) == meta.labels.tolist()
    assert list(message.padding) == meta.padding.tolist()
    assert (message.epoch, message.cursor, message.samples_per_rank) == (2, 14, 100)


def test_round_trip_without_copy_on_the_client():
    pixels, meta = make_batch(n=3, side=16)
    data = _send(GrpcPayloadSender(), pixels, meta)
    wire = parse_batch(data)
    assert not wire.message.images and not wire.message.filler
    batch = InlineReceiver().receive(wire)
    np.testing.assert_array_equal(batch.images.numpy(), pixels)
    start = np.frombuffer(wire.pixels, dtype=np.uint8).ctypes.data
    assert batch.images.data_ptr() == start  # a view of the received bytes
    batch.release()  # nothing to release: no error


def test_received_tensor_outlives_everything_else():
    pixels, meta = make_batch()
    batch = InlineReceiver().receive(parse_batch(_send(GrpcPayloadSender(), pixels, meta)))
    view = batch.images[1:]
    del batch
    np.testing.assert_array_equal(view.numpy(), pixels[1:])
    view.add_(1)  # writable, changes only this batch


def test_head_larger_than_the_room_costs_a_copy_but_stays_correct():
    pixels, meta = make_batch(n=8)
    sender = GrpcPayloadSender(head_reserve_bytes=16)
    data = _send(sender, pixels, meta)
    assert sender.joined_messages == 1
    assert feeder_pb2.Batch.FromString(data).images == pixels.tobytes()


def test_parse_accepts_protobufs_own_serialization():
    pixels, _ = make_batch()
    data = feeder_pb2.Batch(epoch=1, keys=["a"], images=pixels.tobytes(), shape=list(pixels.shape)).SerializeToString()
    wire = parse_batch(data)
    assert wire.message.keys == ["a"]
    assert bytes(wire.pixels) == pixels.tobytes()


@pytest.mark.parametrize("room", [0, 2, 3, 127, 128, 129, 130, 131, 16384, 16385, 16386, 16387, 70000])
def test_filler_fills_exactly(room):
    filler = _filler(room)
    assert filler is not None and len(filler) == room
    assert feeder_pb2.Batch.FromString(filler).filler == bytes(len(feeder_pb2.Batch.FromString(filler).filler))


def test_filler_of_one_byte_is_impossible():
    assert _filler(1) is None


@pytest.mark.parametrize("cut", [1, 5, 40])
def test_truncated_message_is_a_data_error(cut):
    pixels, meta = make_batch()
    data = _send(GrpcPayloadSender(head_reserve_bytes=1024), pixels, meta)
    with pytest.raises(DataError):
        parse_batch(data[:-cut])


def test_shape_that_does_not_match_the_pixels_is_a_data_error():
    data = feeder_pb2.Batch(images=b"\0" * 10, shape=[1, 2, 2, 3]).SerializeToString()
    with pytest.raises(DataError, match="does not match"):
        InlineReceiver().receive(parse_batch(data))


def test_inline_stream_has_nothing_to_release():
    with pytest.raises(InvalidArgument):
        GrpcPayloadSender("s").release(0, 1)


def test_over_a_real_grpc_stream():
    batches = [make_batch(n=2, side=32, seed=s) for s in range(5)]
    sender = GrpcPayloadSender()

    def stream(request, context):
        for pixels, meta in batches:
            yield _send(sender, pixels, meta)

    handler = grpc.unary_stream_rpc_method_handler(stream)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t", {"s": handler}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            call = channel.unary_stream("/t/s", response_deserializer=parse_batch)
            received = [InlineReceiver().receive(wire) for wire in call(b"", timeout=30)]
    finally:
        server.stop(0)
    assert len(received) == 5
    for batch, (pixels, meta) in zip(received, batches):
        assert torch.equal(batch.images, torch.from_numpy(pixels))
        assert list(batch.message.keys) == meta.keys
