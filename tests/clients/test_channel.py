"""The daemon's address: the forms gRPC connects to pass, anything it could only wait
on is refused with one line naming it."""

from __future__ import annotations

import re

import pytest

from clients.channel import check_address
from core.errors import ConfigError


@pytest.mark.parametrize("address", [
    "127.0.0.1:50051", "localhost:1", "feeder-0.cluster.local:65535", "[::1]:50051", "[fe80::1%eth0]:8",
    "dns:///localhost:50051", "dns://8.8.8.8/feeder.example:443", "unix:/run/feeder.sock", "unix:feeder.sock",
    "unix:///run/feeder.sock",
])
def test_addresses_grpc_connects_to_pass(address) -> None:
    check_address(address)


@pytest.mark.parametrize("address", [
    "", "localhost", "127.0.0.1:", "127.0.0.1:0", "127.0.0.1:65536", "127.0.0.1:5x", "::1:50051", "[::1]",
    "[nope]:5", "http://127.0.0.1:50051", "127.0.0.1 :50051", "unix:", "unix://", "unix://relative.sock",
    "dns:///localhost", "dns://8.8.8.8", "-host:5",
])
def test_anything_else_is_refused_naming_it(address) -> None:
    with pytest.raises(ConfigError, match=rf"^address: {re.escape(repr(address))} is not host:port, \[v6\]:port, dns"):
        check_address(address)
