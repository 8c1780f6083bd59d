"""sharder.config: what the configs check, the old on_error word, the progress rule,
and the constants kept here so the configs import without OpenCV or Pillow."""

from __future__ import annotations

import io
import sys
from pathlib import Path

import pytest

from core.errors import ConfigError
from sharder.config import (
    DEFAULT_RESTART_INTERVAL,
    SampleDataConfig,
    ShardConfig,
    VerifyConfig,
    on_error_policy,
    progress_shown,
)
from tests.common.shards import build_sample_shards


def test_default_restart_interval_is_the_jpeg_modules() -> None:
    from shards import jpeg

    assert DEFAULT_RESTART_INTERVAL == jpeg.DEFAULT_RESTART_INTERVAL


@pytest.mark.parametrize("word", ["ignore", "Skip", "", "raise"])
def test_other_on_error_words_are_refused(tmp_path: Path, word: str) -> None:
    with pytest.raises(ConfigError, match="--on-error must be one of skip, fail"):
        ShardConfig(tmp_path, tmp_path / "out", on_error=word)


def test_on_error_policy_keeps_the_current_words() -> None:
    assert [on_error_policy(word) for word in ("skip", "fail")] == ["skip", "fail"]


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("stream,choice,shown", [
    (io.StringIO, None, False), (_Terminal, None, True), (_Terminal, False, False), (io.StringIO, True, True),
])
def test_progress_by_default_only_on_a_terminal(monkeypatch, stream, choice, shown) -> None:
    monkeypatch.setattr(sys, "stderr", stream())
    assert progress_shown(choice) is shown


def test_configs_show_no_bar_unless_asked_or_on_a_terminal(tmp_path: Path) -> None:
    configs = (ShardConfig(tmp_path, tmp_path / "o"), SampleDataConfig(tmp_path), VerifyConfig(tmp_path))
    assert [c.progress for c in configs] == [None, None, None]


def test_verify_takes_a_config_or_a_path(tmp_path_factory: pytest.TempPathFactory) -> None:
    from sharder.verify import verify

    shards = build_sample_shards(tmp_path_factory.mktemp("verify"), classes=2, train_per_class=4, val_per_class=1)
    by_config = verify(VerifyConfig(shards, full=True, seed=3))
    by_path = verify(shards, full=True, seed=3)
    assert by_config == by_path and not by_config.problems and by_config.decoded == 10
    with pytest.raises(TypeError):
        verify(VerifyConfig(shards), full=True)


def test_more_workers_than_cpus_are_cut_to_the_cpus_with_one_line(tmp_path: Path, caplog) -> None:
    from core.cpus import usable_cpus

    cpus = usable_cpus()
    with caplog.at_level("WARNING"):
        config = ShardConfig(tmp_path / "src", tmp_path / "out", workers=1000)
    assert config.workers == cpus
    assert [r.getMessage() for r in caplog.records] == [
        f"--workers 1000: more than the {cpus} CPUs this process may use; using {cpus}"]
    caplog.clear()
    assert ShardConfig(tmp_path / "src", tmp_path / "out", workers=cpus).workers == cpus and not caplog.records
    assert ShardConfig(tmp_path / "src", tmp_path / "out", workers=1000, ray="local").workers == 1000  # Ray's own
