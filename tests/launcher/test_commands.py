"""``feeder run``: its options are ServerConfig's and RunConfig's own, and the daemon
it starts gets only the serve options."""

from __future__ import annotations

from launcher.commands import _serve_args
from launcher.config import RunConfig
from tests.common.options import assert_options_follow


def test_feeder_runs_options_are_the_serve_options_and_the_launchers_own() -> None:
    assert_options_follow("run", RunConfig)  # the serve options documented once, in ServerConfig


def test_the_daemon_of_feeder_run_gets_the_serve_options_as_given_and_none_of_the_launchers() -> None:
    given = ["--dataset", "d=/s", "--restarts", "2", "--port", "7", "--pool-with=h:1,h:2", "--start-timeout-s",
             "9", "--traceback", "--no-antialias"]
    assert _serve_args(given) == ["--dataset", "d=/s", "--port", "7", "--no-antialias"]
