"""``feeder serve`` takes SIGTERM and SIGINT before its server starts: a launcher may
stop it as soon as its health says SERVING, and the default action would end it with
its socket still bound (and its segments unswept)."""

from __future__ import annotations

import signal

import pytest

import feeder.server
from core.errors import ConfigError
from feeder.config import ServerConfig


def test_the_stop_signals_are_taken_before_the_server_starts(monkeypatch, tmp_path):
    seen = {}

    def create_server(config):
        seen.update({s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)})
        raise ConfigError("port: stop here")

    monkeypatch.setattr(feeder.server, "create_server", create_server)
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT)}
    with pytest.raises(ConfigError, match="stop here"):
        feeder.server.serve(ServerConfig(datasets={"d": tmp_path}, device="cpu"))
    assert all(handler not in (signal.SIG_DFL, before[s]) for s, handler in seen.items()), seen
    assert {s: signal.getsignal(s) for s in before} == before  # given back
