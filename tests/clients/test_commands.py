"""``feeder train``: its options are TrainConfig's fields."""

from __future__ import annotations

from clients.config import TrainConfig
from tests.common.options import assert_options_follow


def test_options_are_the_train_config_fields() -> None:
    assert_options_follow("train", TrainConfig)
