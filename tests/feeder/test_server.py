"""The daemon over real gRPC on port 0, with real shards: delivery, resume, shapes,
bad requests, health."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from protos import feeder_pb2
from tests.feeder.conftest import MAX_BATCH, connect, request

DROP, PAD = feeder_pb2.LAST_BATCH_DROP, feeder_pb2.LAST_BATCH_PAD


def _images(batch: feeder_pb2.Batch) -> np.ndarray:
    return np.frombuffer(batch.images, dtype=np.uint8).reshape(tuple(batch.shape))


@pytest.mark.parametrize("world", [1, 2, 3, 7])
@pytest.mark.parametrize("policy", [DROP, PAD])
def test_each_sample_once_per_epoch_across_ranks(stub, index_rows, world, policy):
    n = len(index_rows["train"])
    skipped_before = stub.GetStats(feeder_pb2.StatsRequest()).samples_skipped
    batch_size = 3 if world < 7 else 2  # 64 samples: neither divides a rank's part evenly
    per_rank = [
        list(stub.StreamBatches(
            request(rank=r, world_size=world, batch_size=batch_size, last_batch=policy, seed=5, epoch=2)
        ))
        for r in range(world)
    ]
    assert len({len(batches) for batches in per_rank}) == 1, "ranks must get equal batch counts"
    real = [k for bs in per_rank for b in bs for k, pad in zip(b.keys, b.padding) if not pad]
    assert len(real) == len(set(real)), "a sample was delivered twice"
    assert set(real) <= set(index_rows["train"])
    assert all(len(b.keys) == batch_size for bs in per_rank for b in bs)
    part = n // world if policy == DROP else -(-n // world)
    assert {b.samples_per_rank for bs in per_rank for b in bs} == {part}
    if policy == PAD:
        assert set(real) == set(index_rows["train"])
    else:
        assert not any(p for bs in per_rank for b in bs for p in b.padding)
        assert len(real) == world * (part - part % batch_size)
    skipped = stub.GetStats(feeder_pb2.StatsRequest()).samples_skipped - skipped_before
    assert skipped == (n - len(real) if policy == DROP else 0), "every skipped sample is counted"


def test_ranks_streaming_at_the_same_time_split_the_epoch(stub, index_rows):
    world = 4
    with ThreadPoolExecutor(world) as pool:
        per_rank = list(pool.map(
            lambda r: [
                k for b in stub.StreamBatches(request(rank=r, world_size=world, batch_size=4, epoch=1)) for k in b.keys
            ],
            range(world),
        ))
    assert sorted(k for keys in per_rank for k in keys) == sorted(index_rows["train"])


def test_resume_from_cursor_with_other_batch_and_image_size(stub):
    fields = dict(world_size=3, rank=1, seed=9, epoch=4, last_batch=PAD)
    whole = [(k, p) for b in stub.StreamBatches(request(batch_size=4, **fields)) for k, p in zip(b.keys, b.padding)]
    first = list(stub.StreamBatches(request(batch_size=4, image_size=32, max_samples=10, **fields)))
    assert [len(b.keys) for b in first] == [4, 4, 2] and first[-1].cursor == 10
    rest = list(stub.StreamBatches(request(batch_size=7, image_size=48, start_cursor=first[-1].cursor, **fields)))
    assert {tuple(b.shape[1:]) for b in rest} == {(48, 48, 3)}
    resumed = [(k, p) for b in first + rest for k, p in zip(b.keys, b.padding)]
    part = first[0].samples_per_rank
    assert resumed[:part] == whole[:part], "resumed stream repeats or loses samples"
    assert all(p for _, p in resumed[part:])
    assert rest[-1].cursor == first[0].samples_per_rank


def test_shapes_dtype_and_labels_match_the_index(stub, index_rows):
    batches = list(stub.StreamBatches(request(split="val", batch_size=6, image_size=40, last_batch=PAD)))
    for batch in batches:
        images = _images(batch)
        assert images.shape == (6, 40, 40, 3)
        assert images.std() > 0, "decoded images are not blank"
        assert list(batch.labels) == [index_rows["val"][k] for k in batch.keys]
    keys = [k for b in batches for k, pad in zip(b.keys, b.padding) if not pad]
    assert keys == list(index_rows["val"]), "val comes in stored order"


def test_train_order_depends_on_seed_and_epoch(stub):
    def keys(**f):
        return [k for b in stub.StreamBatches(request(batch_size=8, **f)) for k in b.keys]

    assert keys(seed=1, epoch=0) == keys(seed=1, epoch=0)
    assert keys(seed=1, epoch=0) != keys(seed=1, epoch=1)


def test_several_epochs_back_to_back_match_single_epoch_streams(stub):
    def keys(batches):
        return [(b.epoch, k, b.cursor) for b in batches for k in b.keys]

    fields = dict(batch_size=6, world_size=2, rank=1, seed=3)
    joined = keys(stub.StreamBatches(request(epoch=4, epochs=3, start_cursor=12, **fields)))
    single = keys(stub.StreamBatches(request(epoch=4, start_cursor=12, **fields)))
    for epoch in (5, 6):
        single += keys(stub.StreamBatches(request(epoch=epoch, **fields)))
    assert joined == single
    assert {e for e, _, _ in joined} == {4, 5, 6}


def test_list_datasets_and_stats(stub, index_rows):
    reply = stub.ListDatasets(feeder_pb2.ListDatasetsRequest())
    (info,) = reply.datasets
    assert reply.max_batch_size == MAX_BATCH  # the daemon's --max-batch-size
    assert info.name == "sample"
    assert {s.name: s.num_samples for s in info.splits} == {s: len(r) for s, r in index_rows.items()}
    assert len(info.classes) == 4
    before = stub.GetStats(feeder_pb2.StatsRequest())
    list(stub.StreamBatches(request(batch_size=4, max_samples=8)))
    after = stub.GetStats(feeder_pb2.StatsRequest())
    assert after.images_served - before.images_served == 8
    assert after.batches_served - before.batches_served == 2
    assert after.bytes_sent - before.bytes_sent == 8 * 16 * 16 * 3


BAD_REQUESTS = [
    (dict(dataset="nope"), grpc.StatusCode.NOT_FOUND, "dataset"),
    (dict(split="test"), grpc.StatusCode.NOT_FOUND, "split"),
    (dict(rank=2, world_size=2), grpc.StatusCode.INVALID_ARGUMENT, "rank"),
    (dict(world_size=0), grpc.StatusCode.INVALID_ARGUMENT, "world_size"),
    (dict(batch_size=0), grpc.StatusCode.INVALID_ARGUMENT, "batch_size"),
    (dict(batch_size=MAX_BATCH + 1), grpc.StatusCode.INVALID_ARGUMENT, "batch_size"),
    (dict(image_size=15), grpc.StatusCode.INVALID_ARGUMENT, "image_size"),
    (dict(image_size=1025), grpc.StatusCode.INVALID_ARGUMENT, "image_size"),
    (dict(start_cursor=-1), grpc.StatusCode.INVALID_ARGUMENT, "start_cursor"),
    (dict(start_cursor=65), grpc.StatusCode.INVALID_ARGUMENT, "start_cursor"),
    (dict(min_scale=0.9, max_scale=0.5), grpc.StatusCode.INVALID_ARGUMENT, "min_scale"),
    (dict(last_batch=7), grpc.StatusCode.INVALID_ARGUMENT, "last_batch"),
    (dict(epochs=-1), grpc.StatusCode.INVALID_ARGUMENT, "epochs"),
]


@pytest.mark.parametrize("fields,code,field", BAD_REQUESTS)
def test_bad_requests_name_the_field_and_the_daemon_keeps_serving(stub, fields, code, field):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamBatches(request(**fields)))
    assert caught.value.code() == code
    assert field in caught.value.details()
    assert len(list(stub.StreamBatches(request(max_samples=5)))) == 1


def test_cursor_at_the_end_gives_an_empty_stream(stub):
    assert list(stub.StreamBatches(request(start_cursor=64))) == []


def test_health_serving_and_reflection(server):
    with connect(server[1]) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for service in ("", "feeder.v1.Feeder"):
            reply = health.Check(health_pb2.HealthCheckRequest(service=service))
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
        from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        (reply,) = reflect.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for s in reply.list_services_response.service}
        assert {"feeder.v1.Feeder", "grpc.health.v1.Health"} <= names


def _pixels_by_key(batches) -> dict[str, np.ndarray]:
    return {k: image for b in batches for k, image in zip(b.keys, _images(b))}


def test_augmentation_depends_only_on_seed_epoch_and_key(stub):
    # Different world and batch sizes put each sample in other batches, on other ranks.
    one = _pixels_by_key(stub.StreamBatches(request(batch_size=8, image_size=32, seed=3, epoch=1)))
    split = [request(rank=r, world_size=2, batch_size=5, image_size=32, seed=3, epoch=1) for r in range(2)]
    two = _pixels_by_key(b for r in split for b in stub.StreamBatches(r))
    assert set(two) <= set(one) and len(two) > 50
    assert all(np.array_equal(one[k], two[k]) for k in two)
    other = _pixels_by_key(stub.StreamBatches(request(batch_size=8, image_size=32, seed=3, epoch=2)))
    assert sum(not np.array_equal(one[k], other[k]) for k in one) > len(one) // 2


def test_the_resize_filter_is_a_stream_option(stub):
    fields = dict(split="val", batch_size=4, image_size=24, max_samples=4)
    plain, default, smooth = (
        _images(next(iter(stub.StreamBatches(request(**fields, **extra)))))
        for extra in ({"antialias": False}, {}, {"antialias": True})
    )
    assert np.array_equal(plain, default), "plain bilinear is the default"
    assert not np.array_equal(plain, smooth)
