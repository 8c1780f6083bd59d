"""Fixtures: real sample shards and an in-process daemon on port 0 serving them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pyarrow.parquet as pq
import pytest

from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.server import FeederServer, create_server
from feeder.service import FeederService, open_datasets
from protos import feeder_pb2, feeder_pb2_grpc
from shards.layout import index_path
from tests.common.shards import build_sample_shards

MAX_BATCH = 64


@pytest.fixture(scope="session")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("feeder-shards"))


@pytest.fixture(scope="session")
def photo_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sample shards of photographs of ImageNet's sizes (300-500 px sides): decoding
    them, not the streams' own work per batch, is what keeps a pool busy."""
    return build_sample_shards(tmp_path_factory.mktemp("photo-shards"), train_per_class=64, side_px=(300, 500),
                               shard_size_bytes=1 << 20)


def start(datasets: dict[str, Path], **options) -> tuple[FeederServer, int]:
    defaults = dict(port=0, device="cpu", threads=1, max_batch_size=MAX_BATCH, grace_s=0.5)
    return create_server(ServerConfig.of(datasets=datasets, **(defaults | options)))


def connect(port: int) -> grpc.Channel:
    return grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", -1)])


@pytest.fixture(scope="module")
def server(shards: Path) -> Iterator[tuple[FeederServer, int]]:
    server, port = start({"sample": shards})
    yield server, port
    server.stop(0).wait(10)


@pytest.fixture(scope="module")
def stub(server) -> Iterator[feeder_pb2_grpc.FeederStub]:
    with connect(server[1]) as channel:
        yield feeder_pb2_grpc.FeederStub(channel)


@pytest.fixture(scope="session")
def index_rows(shards: Path) -> dict[str, dict[str, int]]:
    """split -> key -> label, read straight from the index files."""
    rows = {}
    for split in ("train", "val"):
        table = pq.read_table(index_path(shards, split), columns=["key", "label"]).to_pydict()
        rows[split] = dict(zip(table["key"], table["label"]))
    return rows


def request(**fields) -> feeder_pb2.StreamRequest:
    base = dict(dataset="sample", split="train", world_size=1, batch_size=5, image_size=16)
    return feeder_pb2.StreamRequest(**(base | fields))


@pytest.fixture()
def private_server(shards: Path):
    """Makes in-process daemons of their own (``private_server(**config)`` ->
    ``(server, port)``), all stopped after the test."""
    servers: list[tuple[FeederServer, int]] = []

    def make(**options) -> tuple[FeederServer, int]:
        servers.append(start({"sample": shards}, **options))
        return servers[-1]

    yield make
    for server, _ in servers:
        server.stop(0).wait(10)


def _two_threads(shards: Path, max_batch_size: int = 64) -> Iterator[FeederService]:
    config = ServerConfig.of(datasets={"s": shards}, device="cpu", threads=2, prefetch=2,
                             max_batch_size=max_batch_size)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    yield service
    service.close()


@pytest.fixture()
def two_thread_service(shards: Path) -> Iterator[FeederService]:
    """A daemon's service in this process, without gRPC, on a decode pool of 2 threads
    and 2 runs in flight a stream, both given (the tests that compare streams' shares of
    the pool: the tuner, which would take a run from a stream once the pool is busy,
    is what they do not measure)."""
    yield from _two_threads(shards)


@pytest.fixture()
def photo_service(photo_shards: Path) -> Iterator[FeederService]:
    """``two_thread_service`` serving photographs of ImageNet's sizes: where one stream
    must keep a whole pool or half of it busy, decoding them, not its own work per batch,
    is what it waits on, also beside two CPU-bound processes (with the small images, one
    stream alone kept 1.3 of 2 threads busy there)."""
    yield from _two_threads(photo_shards, max_batch_size=256)
