"""The two halves end to end over a real gRPC server on port 0: a hub-driven
stream on the daemon side, StreamReceiver + SlotReleaser on the client side."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager

import grpc
import numpy as np
import pytest

from core.errors import FeederError, grpc_code
from protocol.request import ClientHost
from protos import feeder_pb2
from tests.transport.conftest import make_batch
from transport.base import HostIdentity, TransportConfig, TransportKind
from transport.client import STREAM_BATCHES, SlotReleaser, StreamReceiver
from transport.daemon import TransportHub, TransportRequest
from transport.grpc_payload import parse_batch

BATCHES = 12
SHAPE = (4, 8, 8, 3)


class FakeDaemon:
    """Just the transport part of the daemon: streams pre-made batches."""

    def __init__(self, config: TransportConfig) -> None:
        self.hub = TransportHub(config)
        self.senders: list = []
        self.batches = [make_batch(*SHAPE[:2], seed=s) for s in range(BATCHES)]

    def stream(self, request: feeder_pb2.StreamRequest, context) -> Iterator[bytes]:
        asked = TransportRequest(TransportKind(request.transport), ClientHost.of_request(request))
        sender = self.hub.open_sender(asked, int(np.prod(SHAPE)))
        self.senders.append(sender)
        context.add_callback(lambda: self.hub.close_sender(sender))
        try:
            for pixels, meta in self.batches:
                slot = sender.slot_for(pixels.shape)
                np.copyto(slot.array, pixels)
                yield sender.message(slot, meta)
        finally:
            self.hub.close_sender(sender)

    def release(self, request: feeder_pb2.ReleaseRequest, context) -> feeder_pb2.ReleaseResponse:
        try:
            return feeder_pb2.ReleaseResponse(released=self.hub.release(request.slots))
        except FeederError as e:
            context.abort(grpc_code(e), str(e))
            raise


@contextmanager
def serving(daemon: FakeDaemon) -> Iterator[grpc.Channel]:
    handlers = {
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            daemon.stream, request_deserializer=feeder_pb2.StreamRequest.FromString),
        "ReleaseSlots": grpc.unary_unary_rpc_method_handler(
            daemon.release, request_deserializer=feeder_pb2.ReleaseRequest.FromString,
            response_serializer=feeder_pb2.ReleaseResponse.SerializeToString),
    }
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("feeder.v1.Feeder", handlers),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            yield channel
    finally:
        server.stop(0)


def _release_stub(channel: grpc.Channel):
    return channel.unary_unary(
        "/feeder.v1.Feeder/ReleaseSlots",
        request_serializer=feeder_pb2.ReleaseRequest.SerializeToString,
        response_deserializer=feeder_pb2.ReleaseResponse.FromString,
    )


def _request(shm_dir, transport=feeder_pb2.TRANSPORT_AUTO) -> feeder_pb2.StreamRequest:
    host = HostIdentity.of_this_process(shm_dir)
    return feeder_pb2.StreamRequest(transport=transport, client_host=host.client_host().to_message())


@pytest.mark.slow
@pytest.mark.parametrize("transport, kind", [
    (feeder_pb2.TRANSPORT_AUTO, TransportKind.SHM),
    (feeder_pb2.TRANSPORT_GRPC, TransportKind.GRPC),
])
def test_stream_through_either_transport(shm_dir, transport, kind):
    # Two slots for twelve batches and a long slot wait: every batch goes through
    # the ring only if the released slots come back.
    config = TransportConfig(shm_dir=shm_dir, ring_slots=2, slot_wait_s=20.0)
    daemon = FakeDaemon(config)
    with serving(daemon) as channel:
        releaser = SlotReleaser(_release_stub(channel))
        receiver = StreamReceiver(releaser, shm_dir)
        call = channel.unary_stream(STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        for data, (pixels, meta) in zip(call(_request(shm_dir, transport), timeout=60), daemon.batches, strict=True):
            batch = receiver.receive(parse_batch(data))
            assert receiver.kind == kind
            np.testing.assert_array_equal(batch.images.numpy(), pixels)
            assert list(batch.message.keys) == meta.keys
            del batch  # a CPU consumer done with it: the slot goes back
            gc.collect()
        receiver.close()
        releaser.close()
    assert getattr(daemon.senders[0], "inline_batches", 0) == 0
    if kind == TransportKind.SHM:  # every slot came back through its release word, no call
        assert releaser.calls == 0
    assert list(shm_dir.iterdir()) == []


def test_cancelled_stream_unlinks_its_segment(shm_dir):
    daemon = FakeDaemon(TransportConfig(shm_dir=shm_dir, ring_slots=2, slot_wait_s=20.0))
    with serving(daemon) as channel:
        call = channel.unary_stream(STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        stream = call(_request(shm_dir), timeout=60)
        next(stream)  # the daemon now waits for a slot the client never returns
        assert len(list(shm_dir.iterdir())) == 1
        stream.cancel()
        for _ in range(100):
            if not list(shm_dir.iterdir()):
                break
            time.sleep(0.05)
    assert list(shm_dir.iterdir()) == []


def test_bad_release_is_invalid_argument_and_the_daemon_keeps_serving(shm_dir):
    daemon = FakeDaemon(TransportConfig(shm_dir=shm_dir, ring_slots=2, slot_wait_s=20.0))
    with serving(daemon) as channel:
        release = _release_stub(channel)
        call = channel.unary_stream(STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        stream = call(_request(shm_dir), timeout=60)
        first = parse_batch(next(stream)).message.shm.slot
        assert release(feeder_pb2.ReleaseRequest(slots=[first]), timeout=10).released == 1
        with pytest.raises(grpc.RpcError) as raised:
            release(feeder_pb2.ReleaseRequest(slots=[first]), timeout=10)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        stale = feeder_pb2.SlotRef(stream_id=first.stream_id, index=first.index, generation=first.generation + 5)
        with pytest.raises(grpc.RpcError):
            release(feeder_pb2.ReleaseRequest(slots=[stale]), timeout=10)
        releaser = SlotReleaser(release)
        receiver = StreamReceiver(releaser, shm_dir)
        rest = [receiver.receive(parse_batch(d)).images.numpy().copy() for d in stream]
        assert len(rest) == BATCHES - 1
        releaser.close()
