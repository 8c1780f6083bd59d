"""A pool behind a host name follows the name: addresses it gains join, addresses it
loses (a rotating DNS name, a Service scaled down) are left and the shares drawn
afresh without them."""

from __future__ import annotations

import socket

import pytest

from clients import pool as pool_module
from clients.config import LoaderConfig
from clients.pool import DaemonPool


def _resolving(monkeypatch: pytest.MonkeyPatch, addresses: list[str]) -> None:
    def getaddrinfo(host, port, *args, **kwargs):
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (a, port)) for a in addresses]

    monkeypatch.setattr(pool_module.socket, "getaddrinfo", getaddrinfo)


def test_addresses_a_name_loses_are_left_and_the_shares_redrawn(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: members behind a rotating DNS name were only ever added.
    _resolving(monkeypatch, ["10.0.0.1", "10.0.0.2"])
    config = LoaderConfig(address="feeders.test:50051", dataset="x")
    daemons = DaemonPool(config, ["feeders.test:50051"])
    try:
        assert [m.address for m in daemons.members] == ["10.0.0.1:50051", "10.0.0.2:50051"]
        _resolving(monkeypatch, ["10.0.0.1", "10.0.0.3"])
        generation = daemons.generation
        daemons.follow_names()
        by_address = {m.address: m for m in daemons.members}
        assert by_address["10.0.0.2:50051"].left and "no longer among the addresses" in by_address["10.0.0.2:50051"].why
        assert not by_address["10.0.0.1:50051"].left and "10.0.0.3:50051" in by_address
        assert daemons.generation > generation
    finally:
        daemons.close()
