"""The stream request: one spec, checked once, the same on both sides of the wire."""

from __future__ import annotations

import dataclasses

import pytest

from core.errors import InvalidArgument
from protocol.plan import LastBatch
from protocol.request import (
    AugmentKind,
    ClientHost,
    CropRange,
    MixPart,
    StreamSpec,
    from_request,
    mix_name,
    to_request,
)
from protos import feeder_pb2


def _request(**fields) -> feeder_pb2.StreamRequest:
    return feeder_pb2.StreamRequest(**(dict(world_size=1, batch_size=4, image_size=32) | fields))


def test_from_request_maps_enums_and_crop_defaults():
    spec = from_request(_request(
        dataset="d", split="val", last_batch=feeder_pb2.LAST_BATCH_PAD, augment=feeder_pb2.AUGMENT_TRAIN,
        min_scale=0.25,
    ))
    assert spec.last_batch is LastBatch.PAD and spec.kind is AugmentKind.TRAIN
    assert spec.crop == CropRange(min_scale=0.25)
    assert from_request(_request(split="train")).kind is AugmentKind.TRAIN
    assert from_request(_request(split="val")).kind is AugmentKind.VAL
    assert from_request(_request(epochs=0)).epochs == 1
    with pytest.raises(InvalidArgument, match="augment"):
        from_request(_request(augment=9))


def test_a_spec_survives_the_wire():
    spec = StreamSpec(dataset="d", split="train", rank=2, world_size=3, batch_size=5, image_size=48, seed=-7,
                      epoch=4, start_cursor=10, max_samples=20, epochs=3, last_batch=LastBatch.PAD,
                      augment=AugmentKind.VAL, crop=CropRange(0.25, 0.5, 0.5, 2.0), job_id="j",
                      antialias=True, local_world_size=2, transport=feeder_pb2.TRANSPORT_SHM,
                      client_host=ClientHost("boot", "node-1", 2**64 - 1, "GPU-1", 4321), prefetch_batches=6,
                      shuffle=True)
    assert from_request(to_request(spec)) == spec
    assert from_request(to_request(dataclasses.replace(spec, shuffle=False))).shuffle is False
    plain = from_request(to_request(StreamSpec(dataset="d", split="val")))
    assert plain.antialias is None and plain.client_host is None and not to_request(plain).HasField("client_host")
    assert plain.shuffle is None and not to_request(plain).HasField("shuffle")


@pytest.mark.parametrize("split,augment,shuffle,shuffled", [
    ("train", None, None, True), ("val", None, None, False), ("val", AugmentKind.TRAIN, None, True),
    ("train", AugmentKind.VAL, None, False), ("train", None, False, False), ("val", None, True, True),
    ("train", AugmentKind.VAL, True, True)])
def test_a_stream_is_shuffled_as_it_says_else_as_its_augmentation(split, augment, shuffle, shuffled):
    assert StreamSpec(dataset="d", split=split, augment=augment, shuffle=shuffle).shuffled is shuffled


def test_everything_a_request_carries_is_a_field_of_the_spec():
    # The request is made from the spec alone (to_request): nothing is set on the
    # message afterwards, so every field of the message has its field of the spec.
    crop = {"min_scale", "max_scale", "min_ratio", "max_ratio"}
    fields = {f.name for f in dataclasses.fields(StreamSpec)} - {"crop"} | crop
    assert set(feeder_pb2.StreamRequest.DESCRIPTOR.fields_by_name) == fields


@pytest.mark.parametrize("fields,name", [
    (dict(image_size=8), "image_size"),
    (dict(batch_size=0), "batch_size"),
    (dict(rank=3, world_size=3), "rank"),
    (dict(epochs=0), "epochs"),
    (dict(batch_size=1 << 20, image_size=1024), "batch_size"),
    (dict(seed=2**63), "seed"),
    (dict(transport=9), "transport"),
    (dict(prefetch_batches=-1), "prefetch_batches"),
    (dict(shuffle=1), "shuffle"),
])
def test_a_spec_out_of_range_is_refused_naming_the_field(fields, name):
    with pytest.raises(InvalidArgument) as caught:
        StreamSpec(dataset="d", split="val", **fields)
    assert str(caught.value).startswith(f"{name}:")


@pytest.mark.parametrize("crop,name", [
    (dict(min_scale=0.005), "min_scale"),
    (dict(max_scale=1.5), "max_scale"),
    (dict(min_ratio=0.05), "min_ratio"),
    (dict(min_scale=0.9, max_scale=0.5), "min_scale"),
    (dict(min_ratio=2.0, max_ratio=1.5), "min_ratio"),
])
def test_a_crop_out_of_range_is_refused_naming_the_field(crop, name):
    with pytest.raises(InvalidArgument) as caught:
        CropRange(**crop)
    assert str(caught.value).startswith(f"{name}:")


def test_limits_pass_as_float32_whichever_side_rounded_them():
    crop = CropRange(min_scale=0.01, min_ratio=0.1, max_ratio=10.0)
    assert from_request(to_request(StreamSpec(dataset="d", split="val", crop=crop))).crop.min_scale == \
        pytest.approx(0.01)


def _mix(*parts: tuple[str, float], **fields) -> StreamSpec:
    mix = tuple(MixPart(name, weight) for name, weight in parts)
    return StreamSpec(**(dict(dataset=mix_name(mix), split="train", mix=mix, epoch_samples=100) | fields))


def test_a_mix_survives_the_wire_and_names_its_datasets():
    sha = "ab" * 32
    spec = _mix(("imagenet", 0.8), ("extra", 0.2), epoch_samples=1234)
    spec = from_request(to_request(dataclasses.replace(spec, mix=(MixPart("imagenet", 0.8, sha, sha),
                                                                  MixPart("extra", 0.2)))))
    assert from_request(to_request(spec)) == spec
    assert spec.dataset == "imagenet+extra" and spec.datasets == ("imagenet", "extra")
    assert spec.identities()["imagenet"].manifest_sha256 == sha
    assert StreamSpec(dataset="d", split="val").datasets == ("d",)


@pytest.mark.parametrize("build,name", [
    (lambda: _mix(("a", 0.5), ("b", 0.0)), "mix[1].weight"),
    (lambda: _mix(("a", 0.5), ("b", -1.0)), "mix[1].weight"),
    (lambda: _mix(("a", float("nan")), ("b", 1.0)), "mix[0].weight"),
    (lambda: _mix(("a", float("inf")), ("b", 1.0)), "mix[0].weight"),
    (lambda: _mix(("a", 0.5), ("a", 0.5)), "mix[1].dataset"),
    (lambda: _mix(("a", 0.5), ("", 0.5)), "mix[1].dataset"),
    (lambda: _mix(("a", 0.5), ("b", 0.5), epoch_samples=0), "epoch_samples"),
    (lambda: _mix(("a", 0.5), ("b", 0.5), epoch_samples=-3), "epoch_samples"),
    (lambda: _mix(("a", 0.5), ("b", 0.5), dataset="a"), "dataset"),
    (lambda: StreamSpec(dataset="a", split="train", epoch_samples=10), "epoch_samples"),
])
def test_a_bad_mix_is_refused_naming_the_field(build, name):
    with pytest.raises(InvalidArgument) as caught:
        build()
    assert str(caught.value).startswith(f"{name}:")


def test_a_bad_mix_on_the_wire_is_refused_as_it_is_read():
    request = to_request(_mix(("a", 0.5), ("b", 0.5)))
    request.mix[1].weight = 0.0
    with pytest.raises(InvalidArgument, match=r"^mix\[1\]\.weight"):
        from_request(request)
