"""sharder.config: what the configs check, the old on_error word, and the constants
kept here so the configs import without OpenCV or Pillow."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from sharder.config import DEFAULT_RESTART_INTERVAL, ShardConfig, on_error_policy


def test_default_restart_interval_is_the_jpeg_modules() -> None:
    from shards import jpeg

    assert DEFAULT_RESTART_INTERVAL == jpeg.DEFAULT_RESTART_INTERVAL


def test_on_error_raise_is_fail_with_a_deprecation_warning(tmp_path: Path) -> None:
    with pytest.warns(DeprecationWarning, match="on_error='raise' is deprecated, use 'fail'"):
        config = ShardConfig(tmp_path, tmp_path / "out", on_error="raise")
    assert config.on_error == "fail" and config.options()["on_error"] == "fail"
    assert config == ShardConfig(tmp_path, tmp_path / "out", on_error="fail")


@pytest.mark.parametrize("word", ["ignore", "Skip", ""])
def test_other_on_error_words_are_refused(tmp_path: Path, word: str) -> None:
    with pytest.raises(ConfigError, match="--on-error must be one of skip, fail"):
        ShardConfig(tmp_path, tmp_path / "out", on_error=word)


def test_on_error_policy_keeps_the_current_words() -> None:
    assert [on_error_policy(word) for word in ("skip", "fail")] == ["skip", "fail"]
