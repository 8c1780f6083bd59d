"""The photometric steps as daemon options (``--jitter-*``): off by default, when a
daemon's streams are what they were; on, a daemon decoding with libjpeg-turbo and one
decoding with DALI's CPU decoder jitter a stream alike, and the steps are part of the
pixel options a request's identity carries."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from decode.augment import Jitter
from protocol.identity import digest_for
from protos import feeder_pb2, feeder_pb2_grpc
from shards import jpeg
from tests.feeder.conftest import connect, start

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))]

ON = {f.name: 0.4 for f in fields(Jitter)}
# The sample images are 64-112 px: at 64 px no window is twice the output, so both
# decoders decode every window at full scale, to the same pixels.
_SIZE = 64


def _served(shards: Path, **options: Any) -> tuple[dict[str, str], list[feeder_pb2.Batch]]:
    server, port = start({"sample": shards}, **options)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            listed = dict(stub.ListDatasets(feeder_pb2.ListDatasetsRequest()).pixel_options)
            request = feeder_pb2.StreamRequest(dataset="sample", split="train", world_size=1, batch_size=8,
                                               image_size=_SIZE, seed=11, epoch=2,
                                               pixel_options_sha256=digest_for(listed, None))
            return listed, list(stub.StreamBatches(request, timeout=60))
    finally:
        server.stop(0).wait(10)


def _pixels(batches: list[feeder_pb2.Batch]) -> np.ndarray:
    return np.concatenate([np.frombuffer(b.images, np.uint8).reshape(tuple(b.shape)) for b in batches]).astype(int)


def test_both_cpu_decoders_jitter_a_stream_alike_and_off_nothing_changes(shards: Path):
    plain_options, plain = _served(shards)
    _, off = _served(shards, cpu_decoder="dali", **{name: 0.0 for name in ON})
    on_options, turbo = _served(shards, cpu_decoder="libjpeg-turbo", **ON)
    _, dali = _served(shards, cpu_decoder="dali", **ON)
    keys = [list(b.keys) for b in plain]
    assert [list(b.keys) for b in off] == [list(b.keys) for b in turbo] == [list(b.keys) for b in dali] == keys
    assert np.array_equal(_pixels(off), _pixels(plain))  # off: the default daemon's pixels, whichever decoder
    assert np.abs(_pixels(turbo) - _pixels(dali)).max() <= 1
    assert np.abs(_pixels(turbo) - _pixels(plain)).mean() > 5  # the steps did something
    assert {k: v for k, v in on_options.items() if k not in ON} == plain_options
    assert {k: on_options[k] for k in ON} == {k: "0.4" for k in ON}


def test_a_request_expecting_the_steps_off_is_refused_by_a_daemon_with_them_on(shards: Path):
    plain = {}
    server, port = start({"sample": shards})
    try:
        with connect(port) as channel:
            plain = dict(feeder_pb2_grpc.FeederStub(channel).ListDatasets(feeder_pb2.ListDatasetsRequest())
                         .pixel_options)
    finally:
        server.stop(0).wait(10)
    server, port = start({"sample": shards}, **ON)
    try:
        with connect(port) as channel:
            request = feeder_pb2.StreamRequest(dataset="sample", split="train", world_size=1, batch_size=8,
                                               image_size=_SIZE, pixel_options_sha256=digest_for(plain, None))
            with pytest.raises(grpc.RpcError) as caught:
                list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request, timeout=60))
    finally:
        server.stop(0).wait(10)
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "--jitter-*" in caught.value.details()
