"""The dataset's identity in every request: a daemon restarted on its address with
re-sharded data under the same name is refused on the reconnect instead of resumed
in another permutation; a pool leaves a daemon whose options change pixels; a request
expecting other data gets FAILED_PRECONDITION naming both sides."""

from __future__ import annotations

import hashlib
import logging
import threading
from contextlib import ExitStack
from pathlib import Path

import grpc
import numpy as np
import pytest

from clients import FeederLoader
from core.errors import ConfigError
from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.shards import build_sample_shards

_KW = dict(split="train", batch_size=4, image_size=32, return_keys=True, normalize=False, seed=1, rank=0,
           world_size=1, prefetch_next_epoch=False, reconnect_timeout_s=30)


def _start(shards: Path, port: int = 0, **options) -> tuple[FeederServer, int]:
    return create_server(ServerConfig.of(datasets={"sample": shards}, port=port, device="cpu", threads=1, grace_s=0.5,
                                      **options))


def _pixels(loader: FeederLoader) -> list[tuple[str, str]]:
    """(key, sha256 of its pixels) of every sample of one epoch, in order."""
    found = []
    for images, _, keys in loader:
        for key, image in zip(keys, images):
            found.append((key, hashlib.sha256(np.ascontiguousarray(image.numpy()).tobytes()).hexdigest()))
    return found


@pytest.mark.slow
def test_a_daemon_restarted_on_resharded_data_under_the_name_is_refused_on_reconnect(shards, tmp_path):
    # Before: the reconnect resumed at the old cursor in the new dataset's permutation,
    # silently (a 1,950-sample dataset under a 2,000-sample one's name: 56 never seen).
    other = build_sample_shards(tmp_path, classes=4, train_per_class=31, val_per_class=8, seed=5)
    server, port = _start(shards)
    servers = [server]
    restarted = threading.Event()

    def restart() -> None:
        servers[0].stop(0).wait(10)
        servers.append(_start(other, port)[0])
        restarted.set()

    try:
        with FeederLoader("sample", address=f"127.0.0.1:{port}", prefetch_batches=1, **_KW) as loader:
            with pytest.raises(ConfigError) as raised:  # the daemon's IdentityMismatch
                for n, _ in enumerate(loader):
                    if n == 3:
                        restart()
            assert restarted.is_set() and loader.reconnects >= 1
    finally:
        for s in servers:
            s.stop(0).wait(10)
    message = str(raised.value)
    assert "sample/train" in message and message.count("manifest") >= 2, message


@pytest.mark.slow
def test_a_pool_leaves_a_daemon_whose_options_change_pixels(shards, caplog):
    # Before: a pool mixed an --antialias daemon with default ones: half the samples
    # came with other pixels, no warning.
    caplog.set_level(logging.ERROR, logger="clients.pool")
    with ExitStack() as stack:
        plain, port = _start(shards)
        stack.callback(lambda: plain.stop(0).wait(10))
        with FeederLoader("sample", address=f"127.0.0.1:{port}", **_KW) as loader:
            reference = _pixels(loader)
        blurred, other_port = _start(shards, antialias=True)
        stack.callback(lambda: blurred.stop(0).wait(10))
        with FeederLoader("sample", address=[f"127.0.0.1:{port}", f"127.0.0.1:{other_port}"], **_KW) as loader:
            assert _pixels(loader) == reference
    lines = [r.getMessage() for r in caplog.records if str(other_port) in r.getMessage()]
    assert len(lines) == 1 and "pixel options" in lines[0], lines


def test_a_request_expecting_another_manifest_is_refused_naming_both(daemon):
    with grpc.insecure_channel(daemon) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        served = stub.ListDatasets(feeder_pb2.ListDatasetsRequest()).datasets[0]
        request = feeder_pb2.StreamRequest(dataset="sample", split="train", batch_size=4, image_size=32, world_size=1,
                                           manifest_sha256="ab" * 32, index_sha256=served.splits[1].index_sha256)
        with pytest.raises(grpc.RpcError) as raised:
            next(iter(stub.StreamBatches(request)))
    assert raised.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    details = raised.value.details()
    assert "abababababab" in details and served.manifest_sha256[:12] in details, details


def test_a_request_with_a_digest_that_is_not_one_is_invalid(daemon):
    with grpc.insecure_channel(daemon) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        request = feeder_pb2.StreamRequest(dataset="sample", split="train", batch_size=4, image_size=32, world_size=1,
                                           index_sha256="x" * 10_000)
        with pytest.raises(grpc.RpcError) as raised:
            next(iter(stub.StreamBatches(request)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("index_sha256:") and len(raised.value.details()) < 200
