"""Mixed streams on a real daemon over gRPC: one request carries the datasets and their
weights, the daemon plans the mix (each dataset's share of every epoch and batch, keys
``NAME/key``, labels over the union of the class names), checks every dataset's
identity, refuses a bad mix with one line, and keeps each dataset's bad samples,
counters and decoded images as its plain streams do."""

from __future__ import annotations

import math
import tracemalloc
from collections import Counter
from pathlib import Path

import grpc
import numpy as np
import pyarrow.parquet as pq
import pytest

from core.bad_input import OnError
from core.errors import SampleCorrupt
from feeder.bad_samples import BadSamples, FailureLimits, MixedBadSamples, SampleFilter, Screened, TooManyBadSamples
from feeder.mixed_split import MixedPart, MixedSplit
from feeder.service import open_datasets
from protocol.plan import BatchSlice
from protocol.request import MixPart, StreamSpec, from_request, mix_name
from protocol.stream_plan import mix_of, rank_part_of
from protos import feeder_pb2, feeder_pb2_grpc
from shards.layout import index_path
from tests.common.bad_samples import break_scan, copy_shards
from tests.common.mixes import build_extra_shards, labels_by_key
from tests.feeder.conftest import connect, start


@pytest.fixture(scope="module")
def extra(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_extra_shards(tmp_path_factory.mktemp("extra"))


@pytest.fixture(scope="module")
def mixed_stub(shards, extra):
    server, port = start({"sample": shards, "extra": extra})
    with connect(port) as channel:
        yield server, feeder_pb2_grpc.FeederStub(channel)
    server.stop(0).wait(10)


def mixed(weights=(("sample", 0.75), ("extra", 0.25)), **fields) -> feeder_pb2.StreamRequest:
    parts = [feeder_pb2.MixPart(dataset=name, weight=weight) for name, weight in weights]
    base = dict(dataset="+".join(name for name, _ in weights), split="train", world_size=1, batch_size=8,
                image_size=16, epoch_samples=64, mix=parts)
    return feeder_pb2.StreamRequest(**(base | fields))


@pytest.mark.slow
def test_a_mixed_stream_holds_each_datasets_share_with_labels_over_the_union(mixed_stub, shards, extra):
    server, stub = mixed_stub
    request = mixed(epochs=2)
    batches = list(stub.StreamBatches(request, timeout=60))
    union = ["n00000001", "n00000002", "n00000003", "n00000004", "x-heron", "x-wren"]
    truth = labels_by_key(shards, "sample", union) | labels_by_key(extra, "extra", union)
    spec = from_request(request)
    mix = mix_of(spec, (len(truth) - 24, 24))
    assert mix.counts == (48, 16)
    for epoch in range(2):
        got = [(key, label) for b in batches if b.epoch == epoch for key, label in zip(b.keys, b.labels)]
        assert Counter(key.split("/")[0] for key, _ in got) == {"sample": 48, "extra": 16}
        assert all(truth[key] == label for key, label in got)
        part = rank_part_of(spec, mix, epoch)  # the plan's samples, in its order
        assert [key for key, _ in got] == [_key_of(server, mix, int(i)) for i in part.indices]
    # 32 of extra's sequence of passes: its 24 once (the first pass), then 8 of the second.
    seen = Counter(key for b in batches for key in b.keys if key.startswith("extra/"))
    assert len(seen) == 24 and sorted(Counter(seen.values()).items()) == [(1, 16), (2, 8)]
    for batch in batches:
        extra_count = sum(key.startswith("extra/") for key in batch.keys)
        assert extra_count in (math.floor(len(batch.keys) / 4), math.ceil(len(batch.keys) / 4))


def _key_of(server, mix, index: int) -> str:
    names = ["sample", "extra"]
    k = int(mix.dataset_of([index])[0])
    split = server.service.datasets[names[k]].splits["train"]
    return f"{names[k]}/{split.keys[index - int(mix.offsets[k])]}"


@pytest.mark.parametrize("fields,code,line", [
    (dict(weights=(("sample", 0.75), ("nope", 0.25))), grpc.StatusCode.NOT_FOUND,
     "dataset: 'nope' is not served here (serving ['extra', 'sample'])"),
    (dict(split="val"), grpc.StatusCode.NOT_FOUND, "split: 'extra' has no split 'val' (has ['train'])"),
    (dict(weights=(("sample", 0.75), ("extra", 0.0))), grpc.StatusCode.INVALID_ARGUMENT,
     "mix[1].weight: 0.0 for 'extra' is not a positive finite number"),
    (dict(weights=(("sample", -1.0), ("extra", 1.0))), grpc.StatusCode.INVALID_ARGUMENT, "mix[0].weight: -1.0"),
    (dict(weights=(("sample", math.nan), ("extra", 1.0))), grpc.StatusCode.INVALID_ARGUMENT, "mix[0].weight: nan"),
    (dict(weights=(("sample", math.inf), ("extra", 1.0))), grpc.StatusCode.INVALID_ARGUMENT, "mix[0].weight: inf"),
    (dict(weights=(("sample", 0.5), ("sample", 0.5))), grpc.StatusCode.INVALID_ARGUMENT,
     "mix[1].dataset: 'sample' given twice"),
    (dict(epoch_samples=0), grpc.StatusCode.INVALID_ARGUMENT, "epoch_samples: 0 is not in 1.."),
    (dict(weights=(("sample", 1.0), ("extra", 0.001)), epoch_samples=48), grpc.StatusCode.INVALID_ARGUMENT,
     "mix[1].weight: 0.001 gives 'extra' no sample of an epoch of 48 (epoch_samples)"),
    (dict(dataset="sample"), grpc.StatusCode.INVALID_ARGUMENT, "dataset: 'sample' for a mix of 'sample+extra'"),
])
def test_a_bad_mix_is_refused_with_one_line_and_the_daemon_serves_on(mixed_stub, fields, code, line):
    _, stub = mixed_stub
    weights = fields.pop("weights", (("sample", 0.75), ("extra", 0.25)))
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamBatches(mixed(weights, **fields), timeout=20))
    assert caught.value.code() == code
    assert caught.value.details().startswith(line) and "\n" not in caught.value.details()
    assert len(list(stub.StreamBatches(mixed(max_samples=16), timeout=20))) == 2


def test_a_mix_longer_than_the_daemon_plans_is_refused_before_anything_is_planned(mixed_stub):
    server, stub = mixed_stub
    limit = server.service.config.budgets.max_epoch_samples
    assert stub.ListDatasets(feeder_pb2.ListDatasetsRequest()).max_epoch_samples == limit
    together = sum(len(server.service.datasets[name].splits["train"]) for name in ("sample", "extra"))
    # Planned, the epoch's order alone would take 8 MB (int64 indices), its layout more.
    tracemalloc.start()
    try:
        with pytest.raises(grpc.RpcError) as caught:
            list(stub.StreamBatches(mixed(epoch_samples=10**6), timeout=20))
        peak_bytes = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details() == (
        f"epoch_samples: 1000000 is over this daemon's limit of {limit} (--max-epoch-samples {limit}, or the mix's "
        f"datasets' {together} samples together where more): each epoch's order is built in memory")
    assert peak_bytes < 2 << 20, f"{peak_bytes} bytes allocated while refusing: the epoch was planned"
    assert len(list(stub.StreamBatches(mixed(max_samples=16), timeout=20))) == 2


def test_a_mix_as_long_as_its_datasets_together_is_planned_past_a_smaller_limit(shards, extra):
    server, port = start({"sample": shards, "extra": extra}, max_epoch_samples=16)
    together = sum(len(server.service.datasets[name].splits["train"]) for name in ("sample", "extra"))
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            assert len(list(stub.StreamBatches(mixed(epoch_samples=together, max_samples=16), timeout=60))) == 2
            with pytest.raises(grpc.RpcError) as caught:
                list(stub.StreamBatches(mixed(epoch_samples=together + 1), timeout=20))
    finally:
        server.stop(0).wait(10)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"epoch_samples: {together + 1} is over this daemon's limit of "
                                             f"{together} (--max-epoch-samples 16, ")


def test_every_dataset_of_a_mix_is_checked_against_the_identity_it_expects(mixed_stub):
    _, stub = mixed_stub
    served = {d.name: d.manifest_sha256 for d in stub.ListDatasets(feeder_pb2.ListDatasetsRequest()).datasets}
    request = mixed(max_samples=8)
    request.mix[0].manifest_sha256 = served["sample"]
    assert len(list(stub.StreamBatches(request, timeout=20))) == 1
    request.mix[1].manifest_sha256 = "0" * 64  # another manifest under the name "extra"
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamBatches(request, timeout=20))
    assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert caught.value.details().startswith("extra/train: the request expects manifest 000000000000")


def test_a_bad_sample_of_one_dataset_is_replaced_and_counted_under_its_name(shards, extra, tmp_path):
    broken = copy_shards(extra, tmp_path / "broken")
    key = break_scan(broken, "train", row=3)
    server, port = start({"sample": shards, "extra": broken})
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            batches = list(stub.StreamBatches(mixed(epoch_samples=96, batch_size=8), timeout=60))
            stats = stub.GetStats(feeder_pb2.StatsRequest())
    finally:
        server.stop(0).wait(10)
    registry = server.metrics.registry
    assert registry.get_sample_value("feeder_samples_failed_total", {"dataset": "extra", "split": "train"}) == 1
    assert not registry.get_sample_value("feeder_samples_failed_total", {"dataset": "sample", "split": "train"})
    assert [k for k in stats.failed_keys if k.startswith(f"extra/train/{key}: ")]
    failed = [k for b in batches for k in b.failed_keys]
    assert failed == [f"extra/{key}"]  # its one draw of the epoch (24 drawn of 24), replaced by a marked repeat
    assert len(batches) == 12 and all(len(b.keys) == 8 for b in batches)
    assert f"extra/{key}" not in [k for b in batches for k, p in zip(b.keys, b.padding) if not p]


def test_plain_and_mixed_streams_share_each_datasets_decoded_images(shards, extra):
    server, port = start({"sample": shards, "extra": extra}, decoded_cache_bytes=64 << 20, decoded_cache_side=32)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            plain = feeder_pb2.StreamRequest(dataset="extra", split="train", world_size=1, batch_size=8,
                                             image_size=16)
            assert len(list(stub.StreamBatches(plain, timeout=60))) == 3  # all 24 of extra, cached
            before = server.metrics.stats()
            batches = list(stub.StreamBatches(mixed(), timeout=60))
            after = server.metrics.stats()
    finally:
        server.stop(0).wait(10)
    from_extra = sum(k.startswith("extra/") for b in batches for k in b.keys)
    assert from_extra == 16
    assert after.decoded_cache_hits - before.decoded_cache_hits == from_extra  # the plain stream's, found again
    assert after.decoded_cache_misses - before.decoded_cache_misses == 64 - from_extra


def test_a_mix_of_one_over_its_whole_split_is_its_plain_stream(mixed_stub):
    _, stub = mixed_stub
    plain = feeder_pb2.StreamRequest(dataset="extra", split="train", world_size=2, rank=1, batch_size=4,
                                     image_size=16, epochs=2)
    one = mixed((("extra", 3.0),), world_size=2, rank=1, batch_size=4, epochs=2, epoch_samples=24)
    spec = StreamSpec("extra", "train", mix=(MixPart("extra", 3.0),), epoch_samples=24)
    assert mix_name(spec.mix) == "extra"
    assert [[k.split("/", 1)[1] for k in b.keys] for b in stub.StreamBatches(one, timeout=60)] == \
        [list(b.keys) for b in stub.StreamBatches(plain, timeout=60)]


def test_each_dataset_of_a_mix_is_held_to_the_failure_limit_of_its_own_share(shards, extra):
    opened = open_datasets({"sample": shards, "extra": extra})
    splits = {name: opened[name].splits["train"] for name in ("sample", "extra")}
    mixed = MixedSplit([MixedPart(name, split, np.arange(6)) for name, split in splits.items()])
    bad = MixedBadSamples([BadSamples(name, split, 10**9) for name, split in splits.items()], mixed)
    # A rank's part of 100: 90 of sample (limit 9 an epoch), 10 of extra (limit 1, half a batch of 2).
    samples = SampleFilter(bad, OnError.SKIP, FailureLimits(0.5, 0.1, 100, (90, 10)))

    def failed(*indices: int) -> Screened:
        batch = BatchSlice(np.array(indices), np.zeros(len(indices), dtype=bool), cursor=2, epoch=0)
        return Screened(batch, tuple(indices))

    for first in range(0, 8, 2):  # 8 of sample's: under its limit of 9
        samples.delivered(failed(first, first + 1))
    samples.delivered(failed(64))  # one of extra's (composite 64: its first, after sample's 64): at its limit of 1
    with pytest.raises(TooManyBadSamples) as caught:
        samples.delivered(failed(65))
    assert str(caught.value).startswith("extra/train: 2 samples in epoch 0 so far could not be served (more than 1)")


@pytest.mark.parametrize("read", ["read_many", "read_windows"])
def test_a_changed_sample_is_named_by_its_dataset_key_and_composite_index_whichever_read(shards, extra, tmp_path, read):
    changed = copy_shards(extra, tmp_path / "changed")
    row = pq.read_table(index_path(changed, "train")).to_pylist()[3]
    with open(changed / row["shard"], "r+b") as f:  # one byte of its scan, the index left as it was
        f.seek(row["offset"] + row["size"] // 2)
        byte = f.read(1)[0]
        f.seek(-1, 1)
        f.write(bytes([byte ^ 0xFF]))
    opened = open_datasets({"sample": shards, "extra": changed})
    mixed = MixedSplit([MixedPart(name, opened[name].splits["train"], np.arange(6)) for name in ("sample", "extra")])
    composite = int(mixed.offsets[1]) + 3
    indices = np.array([0, composite, 1])
    with pytest.raises(SampleCorrupt) as caught:
        if read == "read_many":
            mixed.read_many(indices)
        else:
            mixed.read_windows(indices, np.array([[0, 0, 8, 8]] * 3, dtype=np.int32), 16)
    assert (caught.value.key, caught.value.index) == (f"extra/{row['key']}", composite)
    assert caught.value.path == changed / row["shard"]
