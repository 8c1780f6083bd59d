"""``LoaderConfig`` and the ``FeederLoader`` constructor: one set of options, checked
once, with the daemon's own checks for what goes into a request."""

from __future__ import annotations

import dataclasses
import inspect
import typing

import pytest

from clients import FeederLoader, LoaderConfig
from core.errors import ConfigError, InvalidArgument
from protocol.request import MAX_WORLD_SIZE, from_request
from protos import feeder_pb2


def test_the_constructors_parameters_are_the_configs_fields() -> None:
    parameters = list(inspect.signature(FeederLoader.__init__).parameters.values())[1:]  # after self
    fields = dataclasses.fields(LoaderConfig)
    assert [p.name for p in parameters] == [f.name for f in fields]
    hints, field_hints = typing.get_type_hints(FeederLoader.__init__), typing.get_type_hints(LoaderConfig)
    for parameter, field in zip(parameters, fields):
        assert hints[parameter.name] == field_hints[field.name], field.name
        default = inspect.Parameter.empty if field.default is dataclasses.MISSING else field.default
        assert parameter.default == default, field.name
    kinds = [p.kind for p in parameters]
    assert kinds[0] == inspect.Parameter.POSITIONAL_OR_KEYWORD  # dataset: the one argument without a default
    assert set(kinds[1:]) == {inspect.Parameter.KEYWORD_ONLY}


@pytest.mark.parametrize("fields,name", [
    (dict(last_batch="keep"), "last_batch"),
    (dict(augment="flip"), "augment"),
    (dict(transport="rdma"), "transport"),
    (dict(prefetch_batches=0), "prefetch_batches"),
    (dict(connect_timeout_s=float("nan")), "connect_timeout_s"),
    (dict(address="127.0.0.1"), "address"),
])
def test_bad_options_are_refused_naming_them(fields, name) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: "):
        LoaderConfig(**({"address": "127.0.0.1:1", "dataset": "sample"} | fields))


@pytest.mark.parametrize("fields", [
    dict(batch_size=0), dict(image_size=8), dict(image_size=2000), dict(min_scale=0.005), dict(min_scale=1.5),
    dict(rank=2, world_size=2), dict(rank=-1), dict(world_size=MAX_WORLD_SIZE + 1), dict(world_size=0),
    dict(batch_size=4096, image_size=1024),
])
def test_request_fields_are_refused_with_the_daemons_message(fields) -> None:
    # The loader's request with these fields, as a raw message the daemon reads.
    base = dict(dataset="sample", split="train", batch_size=256, image_size=224, world_size=1)
    request = feeder_pb2.StreamRequest(**(base | fields))
    with pytest.raises(InvalidArgument) as daemon_says:
        from_request(request)
    with pytest.raises(ConfigError) as raised:
        LoaderConfig(address="127.0.0.1:1", dataset="sample", **fields)
    assert str(raised.value) == str(daemon_says.value)


def test_a_min_scale_is_checked_as_the_wire_carries_it() -> None:
    # 0.01 as float32 is just below 0.01; the daemon compares float32 limits with
    # float32 values, so it passes there, and here.
    spec = LoaderConfig(address="127.0.0.1:1", dataset="sample", min_scale=0.01).stream_spec(0, 1)
    assert spec.crop.min_scale == pytest.approx(0.01) and spec.crop.min_scale < 0.01


def test_numpy_numbers_are_taken_for_an_epochs_samples_and_a_mixs_weights() -> None:
    import numpy as np

    config = LoaderConfig(address="127.0.0.1:1", dataset={"a": np.float32(0.75), "b": np.float64(0.25)},
                          epoch_samples=np.int64(96))
    assert config.epoch_samples == 96 and type(config.epoch_samples) is int
    assert config.mix == (("a", 0.75), ("b", 0.25))
    with pytest.raises(ConfigError, match="^epoch_samples: must be an integer of 1 or more"):
        LoaderConfig(address="127.0.0.1:1", dataset="a", epoch_samples=np.float64(96))
