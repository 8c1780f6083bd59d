"""sharder.ray_run's check of a ``--ray`` address, which runs before Ray is asked."""

from __future__ import annotations

import socket

import pytest

from core.errors import ConfigError
from sharder.ray_run import _check_answers


def test_an_address_that_accepts_a_connection_passes() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        _check_answers(f"127.0.0.1:{listening.getsockname()[1]}")


def test_an_address_nothing_listens_at_is_refused_naming_it() -> None:
    with socket.create_server(("127.0.0.1", 0)) as listening:
        port = listening.getsockname()[1]
    with pytest.raises(ConfigError, match=f"--ray 127.0.0.1:{port}: no Ray cluster answers there"):
        _check_answers(f"127.0.0.1:{port}")


@pytest.mark.parametrize("address", ["auto", "local", "ray://head.invalid:10001"])
def test_names_ray_resolves_itself_are_left_to_it(address: str) -> None:
    _check_answers(address)
