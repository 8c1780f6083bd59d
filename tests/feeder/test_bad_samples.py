"""A sample that cannot be served (undecodable, or over the pixel cap) under each
error policy: ``skip`` replaces it by a padding-marked repeat and names it, ``fail``
ends the stream with DATA_LOSS naming it."""

from __future__ import annotations

import logging

import grpc
import numpy as np
import pytest

from clients import FeederLoader
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.bad_samples import break_scan, claim_size, copy_shards
from tests.feeder.conftest import connect, request, start

BATCH = 4
VAL_SAMPLES = 16  # the sample shards: 4 classes x 4 val images


@pytest.fixture()
def broken(shards, tmp_path):
    """A copy of the shards whose val sample 5 does not decode: (root, key)."""
    root = copy_shards(shards, tmp_path / "broken")
    return root, break_scan(root, "val", row=5)


@pytest.fixture()
def bomb(shards, tmp_path):
    """A copy of the shards whose index says val sample 2 is 20000 x 20000: (root, key)."""
    root = copy_shards(shards, tmp_path / "bomb")
    return root, claim_size(root, "val", row=2, width=20000, height=20000)


def _serve(root, **options):
    server, port = start({"bad": root}, **options)
    return server, connect(port)


def _val_batches(stub):
    return list(stub.StreamBatches(request(dataset="bad", split="val", batch_size=BATCH)))


def _failed_value(server, name):
    return server.metrics.registry.get_sample_value(name, {"dataset": "bad", "split": "val"}) or 0


def _check_replaced(batches, key):
    assert len(batches) == VAL_SAMPLES // BATCH  # every batch delivered
    hit = [b for b in batches if b.failed_keys]
    assert len(hit) == 1 and list(hit[0].failed_keys) == [key]
    assert key not in [k for b in batches for k in b.keys]
    batch = hit[0]
    (pos,) = [i for i, p in enumerate(batch.padding) if p]
    donor = next(i for i, k in enumerate(batch.keys) if k == batch.keys[pos] and i != pos)
    images = np.frombuffer(batch.images, np.uint8).reshape(tuple(batch.shape))
    assert np.array_equal(images[pos], images[donor])  # a repeat of a good sample
    assert batch.labels[pos] == batch.labels[donor]


def test_an_undecodable_sample_is_replaced_by_a_marked_repeat_and_named(broken, caplog):
    root, key = broken
    server, channel = _serve(root)
    try:
        stub = feeder_pb2_grpc.FeederStub(channel)
        with caplog.at_level(logging.WARNING, logger="feeder"):
            _check_replaced(_val_batches(stub), key)
        stats = stub.GetStats(feeder_pb2.StatsRequest())
        assert stats.samples_failed == 1 and stats.errors == 0
        assert any(key in name and name.startswith("bad/val/") for name in stats.failed_keys)
        assert _failed_value(server, "feeder_samples_failed_total") == 1
        assert [r for r in caplog.records if key in r.getMessage() and "bad/val" in r.getMessage()]
        retries = server.metrics.registry.get_sample_value("feeder_decode_retries_total")
        assert retries >= 1
        # Known from now on: the next stream replaces it before decoding, and says so once.
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="feeder"):
            _check_replaced(_val_batches(stub), key)
        assert server.metrics.registry.get_sample_value("feeder_decode_retries_total") == retries
        assert not [r for r in caplog.records if key in r.getMessage()]
        assert stub.GetStats(feeder_pb2.StatsRequest()).samples_failed == 2
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_a_batch_with_several_bad_samples_keeps_its_good_ones(shards, tmp_path):
    root = copy_shards(shards, tmp_path / "twice")
    keys = [break_scan(root, "val", row=4), break_scan(root, "val", row=6)]
    server, channel = _serve(root)
    try:
        batches = _val_batches(feeder_pb2_grpc.FeederStub(channel))
        assert len(batches) == VAL_SAMPLES // BATCH
        (batch,) = [b for b in batches if b.failed_keys]
        assert sorted(batch.failed_keys) == sorted(keys)
        assert list(batch.padding) == [True, False, True, False]  # rows 4 and 6 of 4..7
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_on_error_fail_ends_the_stream_with_data_loss_naming_the_key(broken):
    root, key = broken
    server, channel = _serve(root, on_error="fail")
    try:
        stub = feeder_pb2_grpc.FeederStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            _val_batches(stub)
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert key in caught.value.details()
        assert stub.GetStats(feeder_pb2.StatsRequest()).errors == 1
        assert len(list(stub.StreamBatches(request(dataset="bad", batch_size=8)))) == 8  # others go on
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_a_sample_over_the_pixel_cap_is_replaced_without_being_decoded(bomb):
    root, key = bomb
    server, channel = _serve(root)
    try:
        stub = feeder_pb2_grpc.FeederStub(channel)
        _check_replaced(_val_batches(stub), key)
        stats = stub.GetStats(feeder_pb2.StatsRequest())
        assert stats.samples_failed == 1
        assert any(key in name for name in stats.failed_keys)
        assert not server.metrics.registry.get_sample_value("feeder_decode_retries_total")
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_on_error_fail_refuses_a_sample_over_the_pixel_cap_naming_its_size(bomb):
    root, key = bomb
    server, channel = _serve(root, on_error="fail", max_pixels=50_000_000)
    try:
        with pytest.raises(grpc.RpcError) as caught:
            _val_batches(feeder_pb2_grpc.FeederStub(channel))
        assert caught.value.code() == grpc.StatusCode.DATA_LOSS
        assert key in caught.value.details() and "20000x20000" in caught.value.details()
        assert "max_pixels" in caught.value.details()
    finally:
        channel.close()
        server.stop(0).wait(10)


def test_the_loader_counts_replaced_samples_and_marks_them_as_padding(broken):
    root, key = broken
    server, port = start({"bad": root})
    try:
        with FeederLoader("bad", address=f"127.0.0.1:{port}", split="val", batch_size=BATCH, image_size=16,
                          rank=0, world_size=1, last_batch="pad", return_padding=True,
                          return_keys=True) as loader:
            batches = list(loader)
            assert len(batches) == VAL_SAMPLES // BATCH
            assert loader.skipped == 1
            assert sum(int(padding.sum()) for *_, padding in batches) == 1
            assert key not in [k for _, _, keys, _ in batches for k in keys]
    finally:
        server.stop(0).wait(10)
