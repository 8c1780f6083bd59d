"""FeederLoader against a daemon that wants a token, TLS, or both, and over a unix
socket."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from clients import FeederLoader
from clients.config import LoaderConfig
from core.errors import ConfigError, Unauthenticated
from feeder.config import ServerConfig
from feeder.server import create_server
from tests.common.sample_daemon import N_TRAIN
from tests.common.tls import Certificates, make_certificates

TOKEN = "loader-test-token"


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture()
def daemon(shards, tmp_path):
    servers = []
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)

    def make(token: bool = True, **options) -> int:
        config = ServerConfig.of(**{"datasets": {"sample": shards}, "port": 0, "device": "cpu", "threads": 1,
                                 "max_batch_size": 64, "grace_s": 0.5, "token_file": token_file if token else None,
                                 **options})
        server, port = create_server(config)
        servers.append(server)
        return port

    yield make
    for server in servers:
        server.stop(0).wait(10)


def _loader(address: str, **options) -> FeederLoader:
    base = dict(dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1, connect_timeout_s=10)
    return FeederLoader(address=address, **(base | options))


def _first_batch_shape(loader: FeederLoader) -> tuple[int, ...]:
    with loader:
        images, _ = next(iter(loader))
        return tuple(images.shape)


def test_token_is_sent_as_call_metadata(daemon, monkeypatch):
    monkeypatch.delenv("FEEDER_TOKEN", raising=False)
    port = daemon()
    assert _first_batch_shape(_loader(f"127.0.0.1:{port}", token=TOKEN)) == (8, 3, 32, 32)
    with pytest.raises(Unauthenticated, match="token"):
        _loader(f"127.0.0.1:{port}")
    with pytest.raises(Unauthenticated, match="token"):
        _loader(f"127.0.0.1:{port}", token="wrong")


def test_feeder_token_is_read_when_the_loader_is_created(daemon, monkeypatch):
    port = daemon()
    monkeypatch.setenv("FEEDER_TOKEN", TOKEN)
    loader = _loader(f"127.0.0.1:{port}")
    monkeypatch.setenv("FEEDER_TOKEN", "changed later")  # the loader keeps what it read
    assert _first_batch_shape(loader) == (8, 3, 32, 32)
    monkeypatch.setenv("FEEDER_TOKEN", "wrong")
    with pytest.raises(Unauthenticated):
        _loader(f"127.0.0.1:{port}")
    assert _first_batch_shape(_loader(f"127.0.0.1:{port}", token=TOKEN)) == (8, 3, 32, 32)


def test_tls_root_and_token(daemon, certs, monkeypatch):
    monkeypatch.delenv("FEEDER_TOKEN", raising=False)
    port = daemon(tls_cert=certs.server_cert, tls_key=certs.server_key)
    loader = _loader(f"127.0.0.1:{port}", token=TOKEN, tls_root=certs.ca)
    assert _first_batch_shape(loader) == (8, 3, 32, 32)


def test_mutual_tls_with_the_loaders_own_certificate(daemon, certs):
    port = daemon(token=False, tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca)
    loader = _loader(f"127.0.0.1:{port}", tls_root=str(certs.ca), tls_cert=certs.client_cert,
                     tls_key=certs.client_key)
    assert _first_batch_shape(loader) == (8, 3, 32, 32)


def test_unix_socket_address(daemon, tmp_path, monkeypatch):
    monkeypatch.delenv("FEEDER_TOKEN", raising=False)
    path = tmp_path / "feeder.sock"
    daemon(socket_path=path)
    assert _first_batch_shape(_loader(f"unix:{path}", token=TOKEN)) == (8, 3, 32, 32)


@pytest.mark.parametrize("fields,name", [
    (dict(tls_cert=Path("c.pem")), "tls_key"),
    (dict(tls_cert=Path("c.pem"), tls_key=Path("k.pem")), "tls_root"),
    (dict(token=""), "token"),
    (dict(token="two\nlines"), "token"),
])
def test_bad_security_options_are_refused(fields, name):
    with pytest.raises(ConfigError, match=name):
        LoaderConfig(address="127.0.0.1:1", dataset="sample", **fields)


def test_an_unreadable_root_certificate_is_named(tmp_path):
    with pytest.raises(ConfigError, match="tls_root: .*missing.pem"):
        _loader("127.0.0.1:1", tls_root=tmp_path / "missing.pem")


def test_the_token_stays_out_of_the_configs_repr():
    assert TOKEN not in repr(LoaderConfig(address="127.0.0.1:1", dataset="sample", token=TOKEN))


def test_a_tls_pool_behind_a_host_name_checks_each_daemon_against_the_name(daemon, tmp_path, monkeypatch):
    # Daemons behind one name (a Kubernetes Service's pods): their certificate names
    # the Service, never the pods' addresses the name resolves to.
    import socket

    from clients import pool as pool_module

    named = make_certificates(tmp_path / "named", server_names="DNS:feeders.test")
    first = daemon(tls_cert=named.server_cert, tls_key=named.server_key, bind="127.0.0.1")
    daemon(tls_cert=named.server_cert, tls_key=named.server_key, bind="127.0.0.2", port=first)

    def getaddrinfo(host, port, *args, **kwargs):
        assert host == "feeders.test"
        return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", (ip, port)) for ip in ("127.0.0.1", "127.0.0.2")]

    monkeypatch.setattr(pool_module.socket, "getaddrinfo", getaddrinfo)
    monkeypatch.delenv("FEEDER_TOKEN", raising=False)
    with _loader(f"feeders.test:{first}", token=TOKEN, tls_root=named.ca, return_keys=True) as loader:
        assert [m.address for m in loader._streams.pool.members] == [f"127.0.0.1:{first}", f"127.0.0.2:{first}"]
        keys = Counter(k for _, _, batch in loader for k in batch)
        assert all(m.usable for m in loader._streams.pool.members)  # both passed the name's check
    assert sum(keys.values()) == N_TRAIN - N_TRAIN % 8 and set(keys.values()) == {1}
