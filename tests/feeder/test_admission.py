"""Budgets a client can run into: the daemon's memory, streams per peer, idle
streams and the bytes of each stream's ready queue."""

from __future__ import annotations

import logging
import os
import queue
import threading
import time

import grpc
import numpy as np
import pytest

from core.errors import ResourceExhausted
from feeder.admission import DECODED_SAMPLE_BYTES, ENCODED_SAMPLE_BYTES, Client, client_of, stream_need_bytes
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.producer import ReadyBatch
from feeder.ready_queue import ReadyQueue
from feeder.service import FeederService, open_datasets
from protocol.batch import BatchMeta
from protocol.request import StreamSpec
from protos import feeder_pb2_grpc
from tests.common.waiting import wait_for
from tests.feeder.conftest import connect, request
from transport.base import host_slot

MIB = 1 << 20




def _config(shards, **options) -> ServerConfig:
    return ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=1, max_batch_size=64, **options)


# -- the estimate -------------------------------------------------------------

def test_need_estimate_counts_queue_send_pipeline_and_look_ahead_buffers(shards):
    batch = 4 * 32 * 32 * 3
    pipeline = 2 * 4 * (DECODED_SAMPLE_BYTES + 2 * 32 * 32 * 3) + 3 * 4 * ENCODED_SAMPLE_BYTES
    config = _config(shards, prefetch=2, lookahead=3, queue_batches=4, queue_bytes=1 << 30)
    assert stream_need_bytes(config, batch_size=4, image_size=32) == (4 + 3) * batch + pipeline
    fewer = _config(shards, prefetch=2, lookahead=3, queue_batches=4, queue_bytes=2 * batch + 1)
    assert stream_need_bytes(fewer, batch_size=4, image_size=32) == (2 + 3) * batch + pipeline
    tiny = _config(shards, prefetch=2, lookahead=3, queue_batches=4, queue_bytes=1)
    assert stream_need_bytes(tiny, batch_size=4, image_size=32) == (1 + 3) * batch + pipeline


# -- memory budget --------------------------------------------------------------

def test_a_stream_past_the_memory_budget_is_refused_naming_budget_and_need(private_server, shards):
    fields = dict(batch_size=8, image_size=64)
    need = stream_need_bytes(_config(shards), **fields)
    server, port = private_server(max_memory_bytes=need + need // 2)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        held = stub.StreamBatches(request(epochs=20, **fields))
        next(held)
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.StreamBatches(request(**fields)))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        details = caught.value.details()
        assert "max_memory" in details and f"{need / MIB:.1f} MiB" in details
        assert f"{(need + need // 2) / MIB:.1f} MiB" in details
        assert server.metrics.registry.get_sample_value("feeder_reserved_bytes") == need
        held.cancel()
        assert wait_for(lambda: server.service.open_streams() == 0)
        assert server.metrics.registry.get_sample_value("feeder_reserved_bytes") == 0
        assert len(list(stub.StreamBatches(request(max_samples=16, **fields)))) == 2


def test_a_request_larger_than_the_whole_budget_is_refused(private_server, shards):
    server, port = private_server(max_memory_bytes=64 * MIB)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.StreamBatches(request(batch_size=64, image_size=512)))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "max_memory" in caught.value.details()
        assert server.metrics.registry.get_sample_value(
            "feeder_streams_refused_total", {"reason": "max_memory"}) == 1
        assert len(list(stub.StreamBatches(request(max_samples=5)))) == 1


# -- streams per client and per job ---------------------------------------------

@pytest.mark.parametrize("peer,pid,key,address", [
    ("ipv4:127.0.0.1:50312", 0, "ipv4:127.0.0.1:50312", "ipv4:127.0.0.1"),
    ("ipv4:10.1.2.3:1", 7, "ipv4:10.1.2.3:1", "ipv4:10.1.2.3"),
    ("ipv6:[::1]:50312", 0, "ipv6:[::1]:50312", "ipv6:[::1]"),
    ("ipv6:[::ffff:127.0.0.1]:50312", 0, "ipv4:127.0.0.1:50312", "ipv4:127.0.0.1"),
    ("ipv6:%5B::1%5D:50312", 0, "ipv6:[::1]:50312", "ipv6:[::1]"),
    ("unix:/run/feeder.sock", 0, "unix", ""),
    ("unix:/run/feeder.sock", 4321, "unix:pid=4321", ""),
    ("unix:", 12, "unix:pid=12", ""),
    ("", 0, "local", ""),
])
def test_a_client_whose_process_is_not_known_is_its_connection_or_over_the_unix_socket_its_pid(
        peer, pid, key, address):
    assert client_of(peer, pid) == Client(key, address)


def _open_from(service, peer: str, job_id: str = ""):
    return service.open_stream(StreamSpec(dataset="sample", split="val", batch_size=4, image_size=16,
                                          job_id=job_id), peer)


def test_one_client_cannot_take_every_stream(shards):
    config = _config(shards, max_streams=8, max_streams_per_peer=2)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    try:
        streams = [_open_from(service, "ipv4:10.0.0.1:1000"), _open_from(service, "ipv4:10.0.0.1:1000")]
        with pytest.raises(ResourceExhausted, match=r"max_streams_per_peer: ipv4:10\.0\.0\.1:1000 .*2"):
            _open_from(service, "ipv4:10.0.0.1:1000")
        streams.append(_open_from(service, "ipv4:10.0.0.1:1001"))  # another process of the same host
        assert service.open_streams() == 3
        streams[0].close()
        streams.append(_open_from(service, "ipv4:10.0.0.1:1000"))
        for stream in streams:
            stream.close()
        assert service.open_streams() == 0
    finally:
        service.close()


def test_one_job_cannot_take_every_stream_whatever_its_connections(shards):
    config = _config(shards, max_streams=8, max_streams_per_job=3)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    try:
        streams = [_open_from(service, f"ipv4:127.0.0.1:{1000 + i}", job_id="j") for i in range(3)]
        with pytest.raises(ResourceExhausted, match=r"max_streams_per_job: job j .*3"):
            _open_from(service, "ipv4:127.0.0.1:2000", job_id="j")
        streams.append(_open_from(service, "ipv4:127.0.0.1:2000", job_id="other"))
        for stream in streams:
            stream.close()
    finally:
        service.close()


def test_connections_whose_processes_are_not_known_have_a_cap_per_address(shards):
    config = _config(shards, max_streams=16, max_streams_per_peer=2, max_streams_per_address=3)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    try:
        streams = [_open_from(service, f"ipv4:10.0.0.1:{1000 + i}") for i in range(3)]  # three connections
        with pytest.raises(ResourceExhausted, match=r"max_streams_per_address: the connections of ipv4:10\.0\.0\.1 "
                                                    r"already have 3 streams open \(limit 3"):
            _open_from(service, "ipv4:10.0.0.1:2000")
        streams.append(_open_from(service, "ipv4:10.0.0.2:2000"))  # another host
        streams.pop(0).close()
        streams.append(_open_from(service, "ipv4:10.0.0.1:2000"))
        for stream in streams:
            stream.close()
    finally:
        service.close()


def test_one_process_is_one_client_whatever_connections_it_opens(private_server):
    server, port = private_server(max_streams_per_peer=3, queue_batches=1)
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(4)]  # four connections of this one process
    try:
        unread = [feeder_pb2_grpc.FeederStub(c).StreamBatches(request(batch_size=16, image_size=128, epochs=20))
                  for c in channels[:3]]
        assert wait_for(lambda: server.service.open_streams() == 3)
        with pytest.raises(grpc.RpcError) as caught:
            next(feeder_pb2_grpc.FeederStub(channels[3]).StreamBatches(request()))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_streams_per_peer: pid={os.getpid()} already has 3 streams" in caught.value.details()
        for call in unread:
            call.cancel()
        assert wait_for(lambda: server.service.open_streams() == 0)
    finally:
        for channel in channels:
            channel.close()


def test_unread_streams_past_the_peer_limit_are_refused_over_grpc(private_server):
    server, port = private_server(max_streams_per_peer=3, queue_batches=1)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        unread = [stub.StreamBatches(request(batch_size=16, image_size=128, epochs=20)) for _ in range(3)]
        assert wait_for(lambda: server.service.open_streams() == 3)
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.StreamBatches(request()))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"max_streams_per_peer: pid={os.getpid()} " in caught.value.details()  # this process
        for call in unread:
            call.cancel()
        assert wait_for(lambda: server.service.open_streams() == 0)


# -- idle streams ---------------------------------------------------------------

@pytest.mark.slow
def test_an_unread_stream_is_cancelled_after_the_idle_timeout(private_server, caplog):
    caplog.set_level(logging.INFO, logger="feeder.service")
    server, port = private_server(idle_timeout_s=1.0)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        # ~0.8 MB batches: gRPC's flow-control window (a few MB) fills, then the
        # daemon's send waits on a client that never reads.
        unread = stub.StreamBatches(request(batch_size=16, image_size=128, epochs=50))
        assert wait_for(lambda: server.service.open_streams() == 1)
        assert wait_for(lambda: server.service.open_streams() == 0, timeout_s=15)
        assert server.metrics.registry.get_sample_value("feeder_queued_bytes") == 0
        assert server.metrics.registry.get_sample_value("feeder_reserved_bytes") == 0
        assert server.metrics.registry.get_sample_value("feeder_streams_idle_cancelled_total") == 1
        with pytest.raises(grpc.RpcError) as caught:
            list(unread)
        assert caught.value.code() == grpc.StatusCode.CANCELLED
    assert any("idle" in r.getMessage() and "cancelled" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_while_a_client_is_refused_for_all_streams_unread_ones_are_cancelled_sooner(private_server):
    server, port = private_server(max_streams=2, idle_timeout_s=600.0, contended_idle_timeout_s=1.0)
    with connect(port) as hog, connect(port) as channel:
        unread = [feeder_pb2_grpc.FeederStub(hog).StreamBatches(request(batch_size=16, image_size=128, epochs=50))
                  for _ in range(2)]
        assert wait_for(lambda: server.service.open_streams() == 2)
        stub = feeder_pb2_grpc.FeederStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.StreamBatches(request()))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED  # the node is now contended
        # Long before --idle-timeout-s, the unread streams give their places up.
        assert wait_for(lambda: server.service.open_streams() == 0, timeout_s=15)
        assert len(list(stub.StreamBatches(request(max_samples=10)))) == 2
        assert server.metrics.registry.get_sample_value("feeder_streams_idle_cancelled_total") == 2
        for call in unread:
            with pytest.raises(grpc.RpcError) as ended:
                list(call)
            assert ended.value.code() == grpc.StatusCode.CANCELLED


@pytest.mark.slow
def test_a_slow_but_steady_reader_is_not_idle(private_server):
    server, port = private_server(idle_timeout_s=2.0)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        call = stub.StreamBatches(request(batch_size=16, image_size=128, epochs=3))
        received = 0
        for _ in call:
            received += 1
            time.sleep(0.3)
        assert received == 3 * 4
    assert server.metrics.registry.get_sample_value("feeder_streams_idle_cancelled_total") == 0


# -- ready queue in bytes ---------------------------------------------------------

def _batch(nbytes: int) -> ReadyBatch:
    meta = BatchMeta(epoch=0, cursor=0, samples_per_rank=1, keys=["k"], labels=np.zeros(1, np.int64),
                     padding=np.zeros(1, bool))
    return ReadyBatch(meta, host_slot((nbytes,)))


def test_ready_queue_is_bounded_in_bytes_as_well_as_batches():
    q = ReadyQueue(max_items=4, max_bytes=250)
    q.put(_batch(100), timeout=0.01)
    q.put(_batch(100), timeout=0.01)
    with pytest.raises(queue.Full):  # a third would pass 250 bytes
        q.put(_batch(100), timeout=0.01)
    assert q.nbytes == 200
    q.get(timeout=0.01)
    q.put(_batch(100), timeout=0.01)
    assert q.nbytes == 200 and len(q) == 2


def test_one_batch_larger_than_the_byte_bound_still_moves():
    q = ReadyQueue(max_items=4, max_bytes=10)
    q.put(_batch(100), timeout=0.01)  # alone in the queue: accepted
    with pytest.raises(queue.Full):
        q.put(_batch(1), timeout=0.01)
    taken = []
    consumer = threading.Thread(target=lambda: taken.append(q.get(timeout=5)))
    consumer.start()
    consumer.join()
    assert taken and q.nbytes == 0


@pytest.mark.slow
def test_queue_bytes_bounds_a_slow_streams_queue(private_server):
    batch_bytes = 16 * 128 * 128 * 3
    server, port = private_server(queue_batches=8, queue_bytes=2 * batch_bytes)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        slow = stub.StreamBatches(request(batch_size=16, image_size=128, epochs=20))
        next(slow)

        def queued() -> float:
            return server.metrics.registry.get_sample_value("feeder_queued_bytes")

        assert wait_for(lambda: queued() > 0)  # its producer went on, however slowly
        time.sleep(2.0)  # time to queue beyond the bound, were there none
        assert 0 < queued() <= 2 * batch_bytes
        slow.cancel()
        assert wait_for(lambda: server.service.open_streams() == 0)
        assert server.metrics.registry.get_sample_value("feeder_queued_bytes") == 0
