"""Shards damaged while the daemon serves them: the daemon lives, the damaged
dataset's streams end with DATA_LOSS naming the shard, other datasets go on."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import feeder_pb2_grpc
from tests.feeder.conftest import connect, request, start


def test_truncating_a_served_dataset_ends_only_its_streams(shards: Path, tmp_path: Path) -> None:
    damaged, intact = (Path(shutil.copytree(shards, tmp_path / name)) for name in ("damaged", "intact"))
    server, port = start({"damaged": damaged, "intact": intact})
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            fields = dict(batch_size=4, epochs=4)
            bad = stub.StreamBatches(request(dataset="damaged", **fields))
            good = stub.StreamBatches(request(dataset="intact", **fields))
            next(bad), next(good)  # both streams have read their shards
            tars = sorted((damaged / "train").glob("*.tar"))
            for tar in tars:
                os.truncate(tar, tar.stat().st_size // 2)
            with pytest.raises(grpc.RpcError) as ended:
                for _ in bad:
                    pass
            assert ended.value.code() == grpc.StatusCode.DATA_LOSS
            assert any(str(tar) in ended.value.details() for tar in tars), ended.value.details()
            assert sum(len(b.keys) for b in good) == 4 * 64 - 4  # the rest of four epochs
            health = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            assert len(list(stub.StreamBatches(request(dataset="intact", batch_size=8)))) == 8
    finally:
        server.stop(0).wait(10)
