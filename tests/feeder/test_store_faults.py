"""What a store says is a state of the store, not of the samples (a real S3 server
under an in-process daemon): an object deleted for seconds and put back, or replaced
by a corrupt copy of the same size, loses no sample and leaves nothing remembered;
a shard gone for longer is skipped, then served again once back; refused credentials
end the stream naming the URL, without blaming a sample; after an outage longer than
the retry window, new streams are served at once (no failed read-ahead handed on).
Each test proves its fault happened (a counter or the daemon's own line)."""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest

from bench.seaweedfs import SeaweedFS
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.s3 import fresh_bucket, pointed_at, store_of, upload_tree
from tests.common.waiting import wait_for
from tests.feeder.conftest import connect, request, start

pytestmark = pytest.mark.slow

_FIELDS = dict(split="train", batch_size=4, image_size=16)


def _keys(batches) -> Counter[str]:
    return Counter(key for b in batches for key, pad in zip(b.keys, b.padding) if not pad)


def _serve(server: SeaweedFS, datasets: dict, **options):
    with pointed_at(server):
        return start(datasets, s3_endpoint=server.endpoint_url, queue_batches=1, prefetch=1, **options)


@pytest.fixture()
def remote(s3_server: SeaweedFS, shards: Path) -> str:
    return upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'faults')}/sample")


def _last_tar(server: SeaweedFS, url: str) -> str:
    store = store_of(server, url)
    return sorted(name for name in store.listing() if name.startswith("train/") and name.endswith(".tar"))[-1]


def _until_met(action, undo, met: Callable[[], bool]) -> threading.Thread:
    """``action()`` now, ``undo()`` in a thread once ``met()`` (the daemon's line about
    the fault was written): the fault lasts until a read has met it, however slowly a
    busy machine reads, and no longer (within the daemon's heal window)."""
    action()

    def undo_when_met() -> None:
        wait_for(met, timeout_s=120)
        undo()

    thread = threading.Thread(target=undo_when_met, daemon=True)
    thread.start()
    return thread


def _logged(caplog: pytest.LogCaptureFixture, line: str) -> Callable[[], bool]:
    return lambda: any(line in record.getMessage() for record in list(caplog.records))


def test_an_object_deleted_for_seconds_and_put_back_loses_nothing_and_is_not_remembered(
        s3_server: SeaweedFS, remote: str, index_rows: dict, caplog) -> None:
    # Before: the samples read while it was gone were replaced (skip) and remembered as
    # bad for good: every later stream of the dataset, any seed, replaced them.
    caplog.set_level(logging.WARNING, logger="shards.troubles")
    # Gone from before the stream's first read of it until the daemon has met that: the
    # heal window (60 s) is where the put-back must fall, its retries a second apart.
    daemon, port = _serve(s3_server, {"remote": remote}, store_heal_s=60)
    store, tar = store_of(s3_server, remote), _last_tar(s3_server, remote)
    data = store.read_bytes(tar)
    missing = f"{remote}/{tar}: missing"
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            back = _until_met(lambda: store.delete([tar]), lambda: store.put_bytes(tar, data), _logged(caplog, missing))
            batches = list(stub.StreamBatches(request(dataset="remote", epochs=2, **_FIELDS)))
            back.join()
            again = list(stub.StreamBatches(request(dataset="remote", seed=9, **_FIELDS)))
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        for epoch in (0, 1):
            assert _keys(b for b in batches if b.epoch == epoch) == Counter(index_rows["train"].keys()), epoch
        assert _keys(again) == Counter(index_rows["train"].keys())
        assert stats.samples_failed == 0 and stats.store_failures > 0, "the store said 404 and nothing was lost"
        assert _logged(caplog, missing)()
    finally:
        daemon.stop(0).wait(10)


def test_a_corrupt_copy_of_the_same_size_then_the_original_serves_the_right_pixels(
        s3_server: SeaweedFS, shards: Path, remote: str, caplog) -> None:
    caplog.set_level(logging.WARNING, logger="shards.troubles")
    daemon, port = _serve(s3_server, {"remote": remote, "local": shards}, store_heal_s=60)
    store, tar = store_of(s3_server, remote), _last_tar(s3_server, remote)
    data = store.read_bytes(tar)
    differ = f"{remote}/{tar}: its bytes differ from the index"
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            fields = dict(_FIELDS, seed=4)
            here = list(stub.StreamBatches(request(dataset="local", **fields)))
            garbage = bytes(b ^ 0x5A for b in data)
            back = _until_met(lambda: store.put_bytes(tar, garbage), lambda: store.put_bytes(tar, data),
                              _logged(caplog, differ))
            there = list(stub.StreamBatches(request(dataset="remote", **fields)))
            back.join()
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        assert [(b.keys, b.labels, b.images) for b in there] == [(b.keys, b.labels, b.images) for b in here]
        assert stats.samples_failed == 0
        assert _logged(caplog, differ)()
    finally:
        daemon.stop(0).wait(10)


def test_a_shard_gone_past_its_heal_window_is_skipped_then_served_again_once_back(
        s3_server: SeaweedFS, remote: str, index_rows: dict) -> None:
    daemon, port = _serve(s3_server, {"remote": remote}, store_heal_s=0.5, max_failed_batch_fraction=1.0,
                          max_failed_epoch_fraction=0.9)
    store, tar = store_of(s3_server, remote), _last_tar(s3_server, remote)
    data = store.read_bytes(tar)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            store.delete([tar])
            gone = list(stub.StreamBatches(request(dataset="remote", **_FIELDS)))
            failed = {key for b in gone for key in b.failed_keys}
            store.put_bytes(tar, data)
            back: list = []

            def whole() -> bool:
                back[:] = list(stub.StreamBatches(request(dataset="remote", **_FIELDS)))
                return _keys(back) == Counter(index_rows["train"].keys()) and not any(b.failed_keys for b in back)

            # Reads start a look at the shard in the background, at most once a second:
            # the epochs after it found the shard back are whole, however late it ran.
            assert wait_for(whole, timeout_s=60), back
        assert failed and not failed & set(_keys(gone)), "skipped and named while gone"
    finally:
        daemon.stop(0).wait(10)


def test_credentials_the_store_refuses_mid_stream_end_it_naming_the_url_and_blame_no_sample(
        s3_server: SeaweedFS, remote: str, index_rows: dict) -> None:
    # The store's keys rotated while a stream reads. Before: its 403s were
    # bad samples, so the stream ended in DATA_LOSS and the samples were remembered.
    daemon, port = _serve(s3_server, {"remote": remote}, store_heal_s=8)
    keys = s3_server.access_key, s3_server.secret_key
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            # Epochs enough that the stream reads from the store again after the rotation,
            # however far ahead of it the daemon has read by then (a busy machine).
            stream = stub.StreamBatches(request(dataset="remote", epochs=200, **_FIELDS))
            next(stream)
            s3_server.rotate_credentials("rotated", "rotated-secret")
            try:
                with pytest.raises(grpc.RpcError) as raised:
                    list(stream)
            finally:
                s3_server.rotate_credentials(*keys)
            again = list(stub.StreamBatches(request(dataset="remote", **_FIELDS)))
            stats = stub.GetStats(feeder_pb2.StatsRequest())
        assert raised.value.code() == grpc.StatusCode.UNAUTHENTICATED, raised.value
        assert remote in raised.value.details() and "feeder-test-secret" not in raised.value.details()
        assert stats.samples_failed == 0
        assert _keys(again) == Counter(index_rows["train"].keys())
    finally:
        daemon.stop(0).wait(10)


def test_after_an_outage_past_the_retry_window_new_streams_are_served_at_once(
        s3_server: SeaweedFS, remote: str, index_rows: dict) -> None:
    # Before: read-aheads that failed in the outage were handed to the next streams'
    # reads, which failed in 0.0 s for 20-53 s after the store was back.
    daemon, port = _serve(s3_server, {"remote": remote}, store_retry_window_s=1.0)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            stream = stub.StreamBatches(request(dataset="remote", epochs=3, **_FIELDS))
            next(stream)
            s3_server.stop(kill=True)
            try:
                with pytest.raises(grpc.RpcError) as raised:
                    list(stream)
            finally:
                s3_server.start()
            back_s = time.monotonic()
            after = list(stub.StreamBatches(request(dataset="remote", seed=2, **_FIELDS)))
            served_s = time.monotonic() - back_s
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE and remote in raised.value.details()
        assert _keys(after) == Counter(index_rows["train"].keys())
        # A stream that met a failed read-ahead would have failed above, not waited.
        print(f"a whole epoch served {served_s:.1f} s after the store was back")  # with -s
    finally:
        daemon.stop(0).wait(10)
