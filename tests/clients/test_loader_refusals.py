"""What the daemon refuses for a budget ends the loader's wait with that refusal, not
with a stall."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from clients import FeederLoader
from core.errors import ResourceExhausted
from feeder.config import ServerConfig
from feeder.server import create_server
from protos import feeder_pb2, feeder_pb2_grpc

# The loader's request fields, also sent to the daemon as they are.
FIELDS = dict(batch_size=8, image_size=32, rank=0, world_size=1)


def _stream(address: str, **fields) -> list[feeder_pb2.Batch]:
    """The batches of a ``StreamBatches`` call with ``fields``, made without the loader."""
    request = feeder_pb2.StreamRequest(dataset="sample", split="train", **(FIELDS | fields))
    with grpc.insecure_channel(address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        return list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request, timeout=60))


def _daemon_refusal(address: str, **fields) -> str:
    with pytest.raises(grpc.RpcError) as refused:
        _stream(address, **fields)
    assert refused.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    return refused.value.details()


def _loader(address: str, **options) -> FeederLoader:
    return FeederLoader(address, "sample", **(FIELDS | {"return_keys": True} | options))


@pytest.fixture()
def starved_daemon(shards) -> Iterator[str]:
    """A daemon whose memory budget admits no stream."""
    config = ServerConfig(datasets={"sample": shards}, port=0, device="cpu", threads=1, max_batch_size=64,
                          grace_s=0.5, max_memory_bytes=1)
    server, port = create_server(config)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


def test_a_memory_refusal_is_reported_with_the_daemons_message(starved_daemon) -> None:
    address = starved_daemon
    expected = _daemon_refusal(address)
    assert expected.startswith("max_memory:")
    with _loader(address, reconnect_timeout_s=1.0) as loader:
        with pytest.raises(ResourceExhausted) as raised:
            next(iter(loader))
        assert loader.reconnects >= 1  # asked again: another stream may have ended meanwhile
    message = str(raised.value)
    assert f"(RESOURCE_EXHAUSTED: {expected})" in message, message
    assert address in message and "cursor 0" in message and "no batch" not in message
