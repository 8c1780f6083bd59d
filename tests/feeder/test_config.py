"""ServerConfig and ``--dataset`` parsing reject what cannot work."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from feeder.commands import parse_datasets
from feeder.config import ServerConfig

OK = {"datasets": {"d": Path("/x")}}


@pytest.mark.parametrize(
    "fields,name",
    [
        ({"datasets": {}}, "datasets"),
        ({"datasets": {"a/b": Path("/x")}}, "dataset name"),
        ({"device": "tpu"}, "device"),
        ({"port": 70000}, "port"),
        ({"metrics_port": -1}, "metrics_port"),
        ({"threads": 0}, "threads"),
        ({"queue_batches": 0}, "queue_batches"),
        ({"max_batch_size": 0}, "max_batch_size"),
        ({"grace_s": -1.0}, "grace_s"),
        ({"on_error": "ignore"}, "on_error"),
        ({"max_pixels": 0}, "max_pixels"),
        ({"max_pipelines": 0}, "max_pipelines"),
        ({"pipeline_idle_s": float("nan")}, "pipeline_idle_s"),
    ],
)
def test_bad_values_name_the_field(fields, name):
    with pytest.raises(ConfigError, match=name):
        ServerConfig(**(OK | fields))


def test_defaults_are_loopback_and_a_bounded_worker_pool():
    config = ServerConfig(**OK)
    assert config.bind == "127.0.0.1" and config.port == 50051
    assert config.worker_threads == config.max_streams + 4


def test_parse_datasets():
    assert parse_datasets(["a=/data/a", "b=rel/b"]) == {"a": Path("/data/a"), "b": Path("rel/b")}
    for bad in (["nopath"], ["=x"], ["a=x", "a=y"]):
        with pytest.raises(ConfigError, match="--dataset"):
            parse_datasets(bad)
