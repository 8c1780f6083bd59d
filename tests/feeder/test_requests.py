"""Every StreamRequest a client can send is answered with batches or a clear gRPC
status, never UNKNOWN or INTERNAL, and the daemon keeps serving afterwards."""

from __future__ import annotations

import math
import time

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from core.errors import InvalidArgument
from protocol.plan import epoch_order
from protocol.request import from_request
from protos import feeder_pb2, feeder_pb2_grpc
from tests.feeder.conftest import connect, request, start
from transport.base import HostIdentity

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)
FIELDS = set(feeder_pb2.StreamRequest.DESCRIPTOR.fields_by_name)
# Codes a well-formed daemon may answer a request with (besides batches).
# FAILED_PRECONDITION: a request expecting another manifest, index or pixel options
# than the daemon's (a fuzzed sha256 field), refused as the identity check does.
ANSWERS = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.RESOURCE_EXHAUSTED,
           grpc.StatusCode.FAILED_PRECONDITION}

OUT_OF_RANGE = [
    (dict(epoch=-1), "epoch"),
    (dict(epoch=2**63 - 1), "epoch"),
    (dict(epoch=2**31 - 1, epochs=2), "epochs"),
    (dict(epochs=-5), "epochs"),
    (dict(rank=-1), "rank"),
    (dict(world_size=-3), "world_size"),
    (dict(world_size=2**31 - 1), "world_size"),
    (dict(batch_size=-1), "batch_size"),
    (dict(image_size=-16), "image_size"),
    (dict(image_size=2**31 - 1), "image_size"),
    (dict(start_cursor=-(2**63)), "start_cursor"),
    (dict(max_samples=-1), "max_samples"),
    (dict(min_scale=1e-30), "min_scale"),
    (dict(min_scale=-0.5), "min_scale"),
    (dict(min_scale=math.nan), "min_scale"),
    (dict(max_scale=1e30), "max_scale"),
    (dict(max_scale=math.inf), "max_scale"),
    (dict(min_scale=0.9, max_scale=0.5), "min_scale"),
    (dict(min_ratio=-math.inf), "min_ratio"),
    (dict(min_ratio=1e-30), "min_ratio"),
    (dict(max_ratio=math.inf), "max_ratio"),
    (dict(max_ratio=1e30), "max_ratio"),
    (dict(max_ratio=math.nan), "max_ratio"),
    (dict(min_ratio=2.0, max_ratio=1.5), "min_ratio"),
    (dict(augment=-1), "augment"),
    (dict(last_batch=2**31 - 1), "last_batch"),
]


@pytest.mark.parametrize("fields,name", OUT_OF_RANGE)
def test_out_of_range_fields_are_refused_naming_the_field(fields, name):
    with pytest.raises(InvalidArgument) as caught:
        from_request(request(**fields))
    assert str(caught.value).startswith(f"{name}:")


@pytest.mark.parametrize("fields,name", OUT_OF_RANGE[:6] + OUT_OF_RANGE[12:14])
def test_out_of_range_fields_over_grpc(stub, fields, name):
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamBatches(request(**fields)))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith(f"{name}:")
    assert len(list(stub.StreamBatches(request(max_samples=5)))) == 1


def _ints(lo: int, hi: int) -> st.SearchStrategy[int]:
    """Any value of the type, the edges of the type and the values next to 0."""
    return st.one_of(st.sampled_from([lo, lo + 1, -1, 0, 1, hi - 1, hi]), st.integers(lo, hi))


def _floats() -> st.SearchStrategy[float]:
    odd = [0.0, -0.0, math.nan, math.inf, -math.inf, 1e-30, 1e30, -1.0, 3.4e38, 1e-45, 0.01, 10.0]
    return st.one_of(st.sampled_from(odd), st.floats(width=32))


# Plausible values of every field (a request built from them alone is served).
USUAL = dict(
    dataset=["sample"], split=["train", "val"], job_id=["", "job-1"], seed=[0, 1, 12345],
    epoch=[0, 1, 7], rank=[0], world_size=[1, 2, 3], batch_size=[1, 4, 16], image_size=[16, 24, 32],
    start_cursor=[0, 3, 20], last_batch=[0, 1], augment=[0, 1, 2], min_scale=[0.0, 0.08, 0.35],
    max_scale=[0.0, 0.5, 1.0], min_ratio=[0.0, 0.5, 0.75], max_ratio=[0.0, 4 / 3, 2.0],
    max_samples=[0, 5, 20], epochs=[0, 1, 2], antialias=[False, True], transport=[0, 1, 2],
    local_world_size=[0, 1, 2],
    client_host=[None, feeder_pb2.ClientHost(), HostIdentity.of_this_process().client_host().to_message()],
    consumed=[[], [feeder_pb2.EpochSegment(world_size=2, cursors=[5, 5])]],
    batch_stride=[0, 1, 3], batch_offset=[0],
    manifest_sha256=[""], index_sha256=[""], pixel_options_sha256=[""], prefetch_batches=[0, 4, 16],
    mix=[[], [feeder_pb2.MixPart(dataset="sample", weight=1.0)]], epoch_samples=[0, 50], shuffle=[None, True, False],
)
# Anything the wire can carry in each field.
ODD = dict(
    dataset=st.text(max_size=20), split=st.sampled_from(["", "test", "../train", "train\x00", "TRAIN"]),
    job_id=st.text(max_size=40), seed=_ints(*INT64), epoch=_ints(*INT64), rank=_ints(*INT32),
    world_size=_ints(*INT32), batch_size=_ints(*INT32), image_size=_ints(*INT32),
    start_cursor=_ints(*INT64), last_batch=_ints(*INT32), augment=_ints(*INT32),
    min_scale=_floats(), max_scale=_floats(), min_ratio=_floats(), max_ratio=_floats(),
    max_samples=_ints(*INT64), epochs=_ints(*INT32), antialias=st.booleans(), transport=_ints(*INT32),
    local_world_size=_ints(*INT32),
    client_host=st.builds(feeder_pb2.ClientHost, boot_id=st.text(max_size=40), hostname=st.text(max_size=20),
                          shm_device=st.integers(0, 2**64 - 1), gpu_uuid=st.text(max_size=40),
                          pid=st.integers(0, 2**32 - 1)),
    consumed=st.lists(st.builds(feeder_pb2.EpochSegment, world_size=_ints(*INT32),
                                cursors=st.lists(_ints(*INT64), max_size=4)), max_size=3),
    batch_stride=_ints(*INT32), batch_offset=_ints(*INT32),
    manifest_sha256=st.text(max_size=80), index_sha256=st.sampled_from(["", "0" * 64, "A" * 64, "f" * 65]),
    pixel_options_sha256=st.text(alphabet="0123456789abcdef", max_size=70), prefetch_batches=_ints(*INT32),
    mix=st.lists(st.builds(feeder_pb2.MixPart, dataset=st.sampled_from(["sample", "", "other", "sample/x"]),
                           weight=st.one_of(_floats(), st.floats()), manifest_sha256=st.text(max_size=70),
                           index_sha256=st.sampled_from(["", "0" * 64, "g" * 64])), max_size=3),
    epoch_samples=_ints(*INT64), shuffle=st.booleans(),
)
assert set(USUAL) == set(ODD) == FIELDS


@st.composite
def stream_requests(draw: st.DrawFn) -> feeder_pb2.StreamRequest:
    """A plausible request with up to three fields set to odd values."""
    fields = {name: draw(st.sampled_from(values)) for name, values in USUAL.items()}
    for name in draw(st.lists(st.sampled_from(sorted(ODD)), max_size=3, unique=True)):
        fields[name] = draw(ODD[name])
    if fields["rank"] == 0 and fields["world_size"] > 1:
        fields["rank"] = draw(st.integers(0, fields["world_size"] - 1))
    if fields["mix"] and draw(st.booleans()):  # most mixes named as a mix's dataset is, to get past that check
        fields["dataset"] = "+".join(part.dataset for part in fields["mix"])
    return feeder_pb2.StreamRequest(**fields)


@pytest.fixture(scope="module")
def fuzz_stub(shards):
    server, port = start({"sample": shards})
    with connect(port) as channel:
        yield server, feeder_pb2_grpc.FeederStub(channel)
    server.stop(0).wait(10)


def _answer(stub, message: feeder_pb2.StreamRequest) -> grpc.StatusCode | int:
    """The status the daemon answers with, or the number of batches taken (at most
    two: a valid request may ask for a long stream)."""
    call = stub.StreamBatches(message, timeout=20)
    taken = 0
    try:
        for _ in call:
            taken += 1
            if taken == 2:
                break
    except grpc.RpcError as e:
        return e.code()
    finally:
        call.cancel()
    return taken


@pytest.mark.slow
@settings(max_examples=150, deadline=None, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(message=stream_requests())
def test_any_request_gets_batches_or_a_clear_status(fuzz_stub, message):
    _, stub = fuzz_stub
    answer = _answer(stub, message)
    event(f"answer: {answer.name if isinstance(answer, grpc.StatusCode) else 'batches'}")
    if isinstance(answer, grpc.StatusCode):
        assert answer in ANSWERS, f"{answer.name} for {message}"


def test_a_stream_whose_every_epoch_is_empty_is_refused_at_once(fuzz_stub):
    server, stub = fuzz_stub
    # A drop batch larger than each rank's part, for as many epochs as may be asked:
    # served, it made no batch for ever (a producer planning 2^31 empty epochs).
    empty = request(split="val", world_size=1000, batch_size=16, epochs=2**31 - 1)
    with pytest.raises(grpc.RpcError) as caught:
        list(stub.StreamBatches(empty, timeout=20))
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert caught.value.details().startswith("batch_size: 16 is larger than rank 0's part of sample/val (0 samples")
    padded = request(split="val", world_size=1000, batch_size=16, last_batch=feeder_pb2.LAST_BATCH_PAD, epochs=3)
    assert [sum(not p for p in b.padding) for b in stub.StreamBatches(padded, timeout=20)] == [1, 1, 1]


def _epochs_and_keys(stub, **fields) -> list[tuple[int, list[str]]]:
    return [(b.epoch, list(b.keys)) for b in stub.StreamBatches(request(split="val", **fields), timeout=60)]


@pytest.mark.parametrize("batch_size,stride", [(16, 5), (4, 3), (4, 4), (5, 2)])
def test_strided_streams_share_the_batches_of_every_epoch(fuzz_stub, batch_size, stride):
    _, stub = fuzz_stub
    fields = dict(batch_size=batch_size, epoch=3, epochs=11, last_batch=feeder_pb2.LAST_BATCH_PAD)
    whole = _epochs_and_keys(stub, **fields)
    assert len({epoch for epoch, _ in whole}) == 11
    for offset in range(stride):
        assert _epochs_and_keys(stub, batch_stride=stride, batch_offset=offset, **fields) == whole[offset::stride]


def test_a_stride_longer_than_an_epoch_takes_its_batch_from_every_1024th_epoch(fuzz_stub):
    _, stub = fuzz_stub
    # One batch an epoch: every 1024th is 1023 epochs further, 2^31 epochs asked.
    call = stub.StreamBatches(request(split="val", batch_size=16, batch_stride=1024, batch_offset=1000,
                                      epochs=2**31 - 1), timeout=20)
    assert [next(call).epoch for _ in range(3)] == [1000, 2024, 3048]
    call.cancel()


def _epoch_keys(stub, split: str, **fields) -> list[str]:
    """The keys of epoch 0 of a whole-epoch stream, each sample once (``pad``'s repeats left out)."""
    batches = stub.StreamBatches(request(split=split, batch_size=16, last_batch=feeder_pb2.LAST_BATCH_PAD, **fields),
                                 timeout=60)
    return [key for b in batches for key, pad in zip(b.keys, b.padding) if not pad]


def test_the_request_says_whether_an_epoch_is_shuffled_whatever_its_augmentation(fuzz_stub):
    server, stub = fuzz_stub
    stored = {split: list(server.service.datasets["sample"].splits[split].keys) for split in ("train", "val")}
    # Train augmentation in the stored order, each sample once.
    assert _epoch_keys(stub, "train", seed=7, shuffle=False) == stored["train"]
    # Validation's transform over the seeded permutation of the train stream's default.
    shuffled = _epoch_keys(stub, "val", seed=7, shuffle=True)
    assert shuffled == [stored["val"][i] for i in epoch_order(len(stored["val"]), 7, 0, shuffle=True)]
    assert sorted(shuffled) == sorted(stored["val"]) and shuffled != stored["val"]
    # Unset: as the augmentation says (validation keeps the stored order).
    assert _epoch_keys(stub, "val", seed=7) == stored["val"]


def test_daemon_serves_normally_after_the_fuzzing(fuzz_stub):
    server, stub = fuzz_stub
    assert [len(b.keys) for b in stub.StreamBatches(request(max_samples=10))] == [5, 5]
    deadline = time.monotonic() + 10
    while server.service.open_streams() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.service.open_streams() == 0, "a refused or cancelled stream stayed open"
