"""What the daemon would refuse, ``FeederLoader`` refuses when it is built, with the
daemon's own message; what the daemon refuses for a budget ends the loader's wait
with that refusal, not with a stall; and a second thread iterating a loader under
way is refused rather than sharing its batches."""

from __future__ import annotations

import re
import threading
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from clients import FeederLoader
from core.errors import ConfigError, ResourceExhausted
from feeder.config import ServerConfig
from feeder.server import create_server
from protocol.request import MAX_WORLD_SIZE
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.sample_daemon import N_TRAIN

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
    return FeederLoader("sample", address=address, **(FIELDS | {"return_keys": True} | options))


@pytest.mark.parametrize("fields", [
    dict(image_size=8),
    dict(min_scale=0.005),
    dict(world_size=MAX_WORLD_SIZE + 1),
    dict(batch_size=100),  # over the test daemon's --max-batch-size of 64
], ids=["image_size", "min_scale", "world_size", "max_batch_size"])
def test_what_the_daemon_refuses_is_refused_at_construction_with_its_message(daemon, fields) -> None:
    expected = _daemon_refusal(daemon, **fields)
    with pytest.raises(ConfigError) as raised:
        _loader(daemon, **fields)
    assert str(raised.value) == expected


def test_a_drop_batch_larger_than_the_ranks_part_is_refused_naming_both(daemon) -> None:
    part = N_TRAIN // 4
    fields = dict(batch_size=part + 8, rank=1, world_size=4)
    refused = _daemon_refusal(daemon, **fields)  # every epoch would be empty
    assert refused.startswith(f"batch_size: {part + 8} is larger than rank 1's part of sample/train ({part} samples")
    with pytest.raises(ConfigError, match=re.escape(refused)):
        _loader(daemon, **fields)
    with _loader(daemon, last_batch="pad", **fields) as padded:  # one batch, filled with repeats
        assert len(padded) == 1 and len(list(padded)) == 1


def test_later_size_changes_are_refused_as_at_construction(daemon) -> None:
    with _loader(daemon) as loader:
        with pytest.raises(ConfigError, match=r"batch_size: 100 is not in 1\.\.64"):
            loader.set_batch_size(100)
        with pytest.raises(ConfigError, match=r"image_size: 8 is not in 16\.\.1024"):
            loader.set_image_size(8)
        with pytest.raises(ConfigError, match=r"min_scale: 0\.005 is not in 0\.01\.\.1"):
            loader.set_min_scale(0.005)
        with pytest.raises(ConfigError, match="image_size: 2000"):
            loader.plan_sizes(3, batch_size=8, image_size=2000)
        with pytest.raises(ConfigError, match="epoch: -1"):
            loader.set_epoch(-1)
        assert (loader.batch_size, loader.image_size) == (8, 32)  # unchanged by what was refused


@pytest.mark.parametrize("address", [
    "localhost", "127.0.0.1:", "127.0.0.1:99999", "::1:50051", "http://127.0.0.1:50051", "unix:",
    "dns:///localhost", "127.0.0.1 :50051",
])
def test_an_address_that_is_not_one_is_refused_without_waiting(address, monkeypatch) -> None:
    monkeypatch.setenv("FEEDER_ADDRESS", address)  # from the environment too
    for given in (address, None):
        with pytest.raises(ConfigError, match=f"^address: {re.escape(repr(address))} is not host:port"):
            FeederLoader("sample", address=given, connect_timeout_s=600)


@pytest.mark.parametrize("address", [None, "", []])
def test_no_address_and_no_feeder_address_is_refused_naming_both(address, monkeypatch) -> None:
    monkeypatch.delenv("FEEDER_ADDRESS", raising=False)
    with pytest.raises(ConfigError, match="^address: none given and FEEDER_ADDRESS is not set"):
        FeederLoader("sample", address=address, connect_timeout_s=600)


def test_no_address_is_the_one_feeder_run_exported(daemon, monkeypatch) -> None:
    # Under `feeder run` a script names its dataset alone: the address is FEEDER_ADDRESS.
    monkeypatch.setenv("FEEDER_ADDRESS", daemon)
    with FeederLoader(dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1, return_keys=True) as loader:
        assert loader.address == daemon
        keys = Counter(k for _, _, batch in loader for k in batch)
    assert sum(keys.values()) == N_TRAIN - N_TRAIN % 8 and set(keys.values()) == {1}


def test_a_pass_begun_in_another_thread_starts_the_epoch_again_and_ends_the_first(daemon, caplog) -> None:
    with _loader(daemon) as loader:
        batches = iter(loader)
        first = next(batches)[2]
        taken: list[tuple] = []
        other = threading.Thread(target=lambda: taken.append(next(iter(loader))))
        other.start()
        other.join()
        assert taken[0][2] == first  # the epoch again from its start: the peeked batch comes again
        assert "a new pass began after 1 batches of an unfinished one" in caplog.text
        with pytest.raises(RuntimeError, match="this iterator ended when a new pass began"):
            next(batches)
        rest = Counter(k for _, _, keys in loader for k in keys)  # a third pass, from the start again
        assert sum(rest.values()) == N_TRAIN // 8 * 8 and set(rest.values()) == {1} and loader.epoch == 1


@pytest.fixture()
def starved_daemon(shards) -> Iterator[str]:
    """A daemon whose memory budget admits no stream."""
    config = ServerConfig.of(datasets={"sample": shards}, port=0, device="cpu", threads=1, max_batch_size=64,
                          grace_s=0.5, max_memory_bytes=1)
    server, port = create_server(config)
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


@pytest.mark.slow
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


def test_the_shared_memory_directory_is_the_one_feeder_run_exported(monkeypatch, tmp_path) -> None:
    from clients.config import LoaderConfig

    monkeypatch.setenv("FEEDER_SHM_DIR", str(tmp_path))
    assert LoaderConfig("sample", address="127.0.0.1:5").shm_path == tmp_path
    given = LoaderConfig("sample", address="127.0.0.1:5", shm_dir=Path("/run/shm"))
    assert given.shm_path == Path("/run/shm")  # given wins
    monkeypatch.delenv("FEEDER_SHM_DIR")
    assert LoaderConfig("sample", address="127.0.0.1:5").shm_path == Path("/dev/shm")
