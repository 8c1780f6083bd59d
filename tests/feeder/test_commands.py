"""``feeder serve``: its options are ServerConfig's fields,
bad values are one line and exit 1."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from feeder.config import ServerConfig
from tests.common.options import assert_options_follow


def test_options_are_the_server_config_fields() -> None:
    assert_options_follow("serve", ServerConfig)


@pytest.fixture
def served(monkeypatch: pytest.MonkeyPatch) -> list[ServerConfig]:
    """The configs ``feeder serve`` would serve with (the daemon is not started)."""
    configs: list[ServerConfig] = []
    monkeypatch.setattr("feeder.server.serve", configs.append)
    return configs


def _serve(tmp_path: Path, *args: str):
    return CliRunner().invoke(app, ["serve", "--dataset", f"d={tmp_path}", *args])


def test_options_reach_the_config(tmp_path: Path, served: list[ServerConfig]) -> None:
    result = _serve(tmp_path, "--dataset", f"e={tmp_path}/e", "--shm-budget-bytes", "1G", "--max-memory-bytes", "2G",
                    "--socket-path", str(tmp_path / "s.sock"), "--queue-bytes", "512M", "--on-error", "fail")
    assert result.exit_code == 0, result.output
    (config,) = served
    assert config.datasets == {"d": tmp_path, "e": tmp_path / "e"}
    budgets = config.budgets
    assert (config.shm.shm_budget_bytes, budgets.max_memory_bytes, budgets.queue_bytes) == (1 << 30, 2 << 30, 512 << 20)
    assert config.socket_path == tmp_path / "s.sock" and config.decoding.on_error == "fail" and result.stderr == ""


def test_defaults_are_the_config_defaults(tmp_path: Path, served: list[ServerConfig]) -> None:
    assert _serve(tmp_path).exit_code == 0
    assert served == [ServerConfig.of(datasets={"d": tmp_path})]


@pytest.mark.parametrize("args,line", [
    (("--queue-bytes", "12X"), "feeder: error: --queue-bytes '12X': expected a size such as 8G, 512M or 1073741824"),
    (("--dataset", "noequals"), "feeder: error: --dataset 'noequals': expected NAME=PATH, e.g. imagenet=/data/shards"),
    (("--on-error", "raise"), "feeder: error: on_error: 'raise' is not one of skip, fail"),
])
def test_bad_values_are_one_line_and_exit_1(tmp_path, served, args, line) -> None:
    result = _serve(tmp_path, *args)
    assert result.exit_code == 1 and not served
    assert result.stderr.splitlines() == [line]
