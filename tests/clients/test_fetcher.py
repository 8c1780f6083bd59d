"""The stall deadline: a daemon that stops sending without ending the stream makes the
loader reconnect at its cursor, and give up with a clear error, never hang (a fake
daemon in process; a ``feeder serve`` stopped with SIGSTOP in the slow test); a
request the daemon refuses ends the stream at once."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures

import grpc
import pytest

from clients import FeederLoader
from clients.fetcher import StreamFetcher
from clients.loader_config import LoaderConfig
from clients.connection import Connection
from core.errors import ConfigError, InvalidArgument, ServiceUnavailable
from feeder.launcher import DaemonProcess
from protocol.plan import LastBatch
from protocol.request import StreamSpec, to_request
from protos import feeder_pb2, feeder_pb2_grpc

SAMPLES = 24
SIDE = 16  # the smallest side a request may ask for


class StallingFeeder(feeder_pb2_grpc.FeederServicer):
    """Serves ``SAMPLES`` tiny samples of dataset ``fake``; a stream stops sending (and
    keeps the call open) where ``stalls(call_index, cursor)`` says so."""

    def __init__(self, stalls: Callable[[int, int], bool]) -> None:
        self.stalls = stalls
        self.calls = 0
        self._lock = threading.Lock()

    def ListDatasets(self, request, context):
        split = feeder_pb2.SplitInfo(name="train", num_samples=SAMPLES)
        info = feeder_pb2.DatasetInfo(name="fake", splits=[split], classes=["a"])
        return feeder_pb2.ListDatasetsResponse(datasets=[info])

    def StreamBatches(self, request, context) -> Iterator[feeder_pb2.Batch]:
        with self._lock:
            call, self.calls = self.calls, self.calls + 1
        cursor = request.start_cursor
        while cursor < SAMPLES:
            if self.stalls(call, cursor):
                while context.is_active():  # sends nothing until the client goes away
                    time.sleep(0.05)
                return
            n = min(request.batch_size, SAMPLES - cursor)
            yield feeder_pb2.Batch(
                epoch=request.epoch, cursor=cursor + n, keys=[str(i) for i in range(cursor, cursor + n)],
                labels=[0] * n, images=bytes(n * SIDE * SIDE * 3), shape=[n, SIDE, SIDE, 3],
                samples_per_rank=SAMPLES)
            cursor += n


@pytest.fixture
def fake_daemon() -> Iterator[Callable[[Callable[[int, int], bool]], str]]:
    servers = []

    def start(stalls: Callable[[int, int], bool]) -> str:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=8))
        feeder_pb2_grpc.add_FeederServicer_to_server(StallingFeeder(stalls), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        server.stop(0).wait(10)


def _loader(address: str, **options) -> FeederLoader:
    base = {"dataset": "fake", "batch_size": 4, "image_size": SIDE, "rank": 0, "world_size": 1,
            "return_keys": True, "normalize": False, "prefetch_batches": 1,
            "stall_timeout_s": 0.5, "reconnect_timeout_s": 5.0}
    return FeederLoader(address, **(base | options))


def test_stalled_stream_reopens_at_its_cursor_without_loss_or_repeat(fake_daemon) -> None:
    address = fake_daemon(lambda call, cursor: call == 0 and cursor == 8)
    started = time.monotonic()
    with _loader(address) as loader:
        keys = [k for _, _, batch_keys in loader for k in batch_keys]
        assert loader.reconnects >= 1
    assert keys == [str(i) for i in range(SAMPLES)]
    assert time.monotonic() - started < 10


def test_gives_up_naming_daemon_dataset_split_rank_and_cursor(fake_daemon) -> None:
    address = fake_daemon(lambda call, cursor: call > 0 or cursor == 8)
    started = time.monotonic()
    with _loader(address, reconnect_timeout_s=1.0, rank=1, world_size=2) as loader:
        with pytest.raises(ServiceUnavailable) as raised:
            for _ in loader:
                pass
        assert loader.reconnects >= 1
    message = str(raised.value)
    for part in (address, "'fake'", "'train'", "rank 1 of 2", "cursor 8", "no batch for"):
        assert part in message, message
    assert time.monotonic() - started < 10


def test_a_refused_request_ends_the_stream_at_once_without_retrying(daemon) -> None:
    connection = Connection(LoaderConfig(address=daemon, dataset="sample"), daemon)
    # Over the test daemon's --max-batch-size of 64: a loader would refuse it itself.
    spec = StreamSpec("sample", "train", batch_size=1000, image_size=32, last_batch=LastBatch.PAD)
    fetcher = StreamFetcher(connection.stream_batches, to_request(spec), daemon, depth=1,
                            reconnect_timeout_s=600, pin=False, stall_timeout_s=600)
    try:
        with pytest.raises(InvalidArgument, match=r"batch_size: 1000 is not in 1\.\.64"):
            fetcher.get()
        assert fetcher.reconnects == 0
    finally:
        fetcher.close()
        connection.close()


def test_stall_timeout_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="stall_timeout_s"):
        _loader("127.0.0.1:9", stall_timeout_s=0)


class _DeafCall:
    """A call that never sends and ignores cancel (a stuck transport)."""

    def __init__(self, released: threading.Event) -> None:
        self._released = released

    def __iter__(self) -> Iterator[feeder_pb2.Batch]:
        self._released.wait()
        return iter(())

    def cancel(self) -> None:
        pass


def test_get_gives_up_even_when_the_stream_ignores_cancel() -> None:
    released = threading.Event()
    request = feeder_pb2.StreamRequest(dataset="fake", split="train", rank=0, world_size=1)
    fetcher = StreamFetcher(lambda _: _DeafCall(released), request, "127.0.0.1:9", depth=1,
                            reconnect_timeout_s=0.5, pin=False, stall_timeout_s=0.5)
    started = time.monotonic()
    try:
        with pytest.raises(ServiceUnavailable, match="127.0.0.1:9"):
            fetcher.get()
        assert time.monotonic() - started < 8
    finally:
        released.set()
        fetcher.close()


@pytest.mark.slow
def test_stopped_daemon_process_is_a_clear_error_not_a_hang(shards) -> None:
    with DaemonProcess({"sample": shards}, options=("--device", "cpu", "--threads", "1")) as daemon:
        loader = FeederLoader(daemon.address, dataset="sample", batch_size=2, image_size=32,
                              rank=0, world_size=1, prefetch_batches=1, stall_timeout_s=1.0,
                              reconnect_timeout_s=2.0)
        batches = iter(loader)
        next(batches)
        os.kill(daemon.pid, signal.SIGSTOP)  # stops sending, keeps its connections open
        started = time.monotonic()
        try:
            with pytest.raises(ServiceUnavailable, match=daemon.address):
                for _ in batches:
                    pass
            assert time.monotonic() - started < 10
            assert loader.reconnects >= 1
        finally:
            os.kill(daemon.pid, signal.SIGCONT)
            loader.close()
