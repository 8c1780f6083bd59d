"""``feeder train``: its options are TrainConfig's fields."""

from __future__ import annotations

import pytest

from clients.config import TrainConfig
from core.errors import ConfigError
from tests.common.options import assert_options_follow


def test_options_are_the_train_config_fields() -> None:
    assert_options_follow("train", TrainConfig)


def test_the_daemon_is_the_one_feeder_run_exported_when_no_server_is_given(monkeypatch) -> None:
    monkeypatch.setenv("FEEDER_ADDRESS", "unix:/run/feeder/feeder.sock")
    assert TrainConfig(dataset="sample").server == "unix:/run/feeder/feeder.sock"
    assert TrainConfig(server="127.0.0.1:5", dataset="sample").server == "127.0.0.1:5"  # given wins
    assert TrainConfig(dataset="sample", data="synthetic").server == ""  # synthetic data needs none
    monkeypatch.delenv("FEEDER_ADDRESS")
    with pytest.raises(ConfigError, match=r"^--server HOST:PORT \(or FEEDER_ADDRESS, which feeder run sets\)"):
        TrainConfig(dataset="sample")
