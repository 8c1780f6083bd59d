"""A tar changed in place while it is served, same size (``dd conv=notrunc``,
``rsync --inplace`` of a re-sharded copy): no wrong pixels are ever delivered under a
key, the stream ends with DATA_LOSS naming the shard (or, below the limits, each bad
sample is skipped and named), and putting the bytes back restores service without a
restart."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import grpc
import numpy as np
import pyarrow.parquet as pq
import pytest

from protos import feeder_pb2_grpc
from shards.layout import index_path
from tests.feeder.conftest import connect, request, start

_FIELDS = dict(split="val", batch_size=4, image_size=16)


def _pixels(batch) -> np.ndarray:
    return np.frombuffer(batch.images, np.uint8).reshape(tuple(batch.shape))


def _by_key(batches) -> dict[str, np.ndarray]:
    """Key -> pixels of every sample that is not a repeat."""
    return {key: image for b in batches for key, image, pad in zip(b.keys, _pixels(b), b.padding) if not pad}


def _stream(stub, dataset: str, **fields) -> list:
    return list(stub.StreamBatches(request(dataset=dataset, **(_FIELDS | fields))))


@pytest.fixture()
def served(shards: Path, tmp_path: Path):
    """A daemon over a private copy (``changed``) and the original (``intact``); the
    reference pixels of the val split, from the intact copy."""
    copy = Path(shutil.copytree(shards, tmp_path / "changed"))
    server, port = start({"changed": copy, "intact": shards})
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        yield copy, stub, _by_key(_stream(stub, "intact"))
    server.stop(0).wait(10)


def _first_tar(root: Path) -> tuple[Path, list[dict]]:
    rows = pq.read_table(index_path(root, "val")).to_pylist()
    shard = rows[0]["shard"]
    return root / shard, [r for r in rows if r["shard"] == shard]


def _overwrite_in_place(tar: Path, data: bytes) -> bytes:
    """Write ``data`` over the start of ``tar`` without truncating it; the old bytes."""
    before = tar.read_bytes()
    with open(tar, "r+b") as f:
        f.write(data[: len(before)])
    return before


@pytest.mark.slow
def test_a_tar_overwritten_in_place_ends_the_stream_naming_it_and_serves_no_wrong_pixels(served):
    copy, stub, reference = served
    tar, _ = _first_tar(copy)
    other = next(t for t in sorted((copy / "train").glob("*.tar")))
    delivered: list = []
    original = _overwrite_in_place(tar, other.read_bytes())
    with pytest.raises(grpc.RpcError) as ended:
        for batch in stub.StreamBatches(request(dataset="changed", **_FIELDS)):
            delivered.append(batch)
    assert ended.value.code() == grpc.StatusCode.DATA_LOSS
    assert str(tar) in ended.value.details(), ended.value.details()
    for key, image in _by_key(delivered).items():  # whatever came before the end is right
        assert np.array_equal(image, reference[key]), key
    _overwrite_in_place(tar, original)  # put right, in place: same file, new mtime
    time.sleep(1.1)  # the reader looks at a tar's path at most once a second
    restored = _stream(stub, "changed")
    assert not [k for b in restored for k in b.failed_keys]
    got = _by_key(restored)
    assert got.keys() == reference.keys() and all(np.array_equal(got[k], reference[k]) for k in got)


def test_one_changed_sample_is_skipped_and_named_below_the_limits(served):
    copy, stub, reference = served
    tar, rows = _first_tar(copy)
    sample = rows[1]
    with open(tar, "r+b") as f:  # one byte of its entropy-coded data: same size, other bytes
        f.seek(sample["offset"] + sample["size"] // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 0x55]))
    batches = _stream(stub, "changed")
    assert [k for b in batches for k in b.failed_keys] == [sample["key"]]
    got = _by_key(batches)
    assert sample["key"] not in got and len(got) == len(reference) - 1
    assert all(np.array_equal(got[k], reference[k]) for k in got)


def test_a_changed_sample_under_fail_ends_the_stream_naming_tar_and_key(shards: Path, tmp_path: Path):
    copy = Path(shutil.copytree(shards, tmp_path / "changed"))
    tar, rows = _first_tar(copy)
    with open(tar, "r+b") as f:
        f.seek(rows[0]["offset"] + 10)
        f.write(b"\x00\x01\x02")
    server, port = start({"changed": copy}, on_error="fail")
    try:
        with connect(port) as channel, pytest.raises(grpc.RpcError) as ended:
            _stream(feeder_pb2_grpc.FeederStub(channel), "changed")
        assert ended.value.code() == grpc.StatusCode.DATA_LOSS
        assert str(tar) in ended.value.details() and rows[0]["key"] in ended.value.details()
    finally:
        server.stop(0).wait(10)


def test_more_changed_samples_in_an_epoch_than_its_limit_end_the_stream(served):
    copy, stub, _ = served
    rows = pq.read_table(index_path(copy, "val")).to_pylist()
    for sample in rows[0:12:4]:  # three samples, each in a batch of its own: under the batch limit
        with open(copy / sample["shard"], "r+b") as f:
            f.seek(sample["offset"] + sample["size"] // 2)
            f.write(b"\xa5\x5a")
    with pytest.raises(grpc.RpcError) as ended:
        _stream(stub, "changed")  # an epoch of 16 allows half a batch: 2
    assert ended.value.code() == grpc.StatusCode.DATA_LOSS
    assert "3 samples in epoch 0 so far" in ended.value.details(), ended.value.details()
