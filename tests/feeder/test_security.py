"""An open network: TLS (and mutual TLS), a bearer token checked on every call but
the health check, loopback unless told otherwise, an owner-only unix socket, and the
metrics endpoint on the service's address."""

from __future__ import annotations

import os
import stat
import time
import urllib.error
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.errors import ConfigError
from feeder.config import ServerConfig
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.tls import Certificates, make_certificates
from tests.feeder.conftest import connect, request, start

TOKEN = "s3cret-token-for-tests"
OPTIONS = [("grpc.max_receive_message_length", -1)]


@pytest.fixture(scope="module")
def certs(tmp_path_factory) -> Certificates:
    return make_certificates(tmp_path_factory.mktemp("certs"))


@pytest.fixture()
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    path.chmod(0o600)
    return path



def _bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _tls_channel(port: int, certs: Certificates, client_cert: bool = False, host: str = "127.0.0.1"):
    key_pair = (certs.client_key.read_bytes(), certs.client_cert.read_bytes()) if client_cert else (None, None)
    credentials = grpc.ssl_channel_credentials(certs.ca.read_bytes(), *key_pair)
    return grpc.secure_channel(f"{host}:{port}", credentials, options=OPTIONS)


def _health(channel: grpc.Channel) -> int:
    return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=10).status


# -- configuration ----------------------------------------------------------------

BASE = {"datasets": {"d": Path("/x")}}


@pytest.mark.parametrize("bind", ["0.0.0.0", "::", "10.1.2.3", "feeder.example.com"])
def test_a_non_loopback_bind_needs_tls_and_a_token_or_insecure(bind, certs, token_file):
    with pytest.raises(ConfigError, match=r"bind: .* --insecure") as caught:
        ServerConfig.of(**BASE, bind=bind)
    assert "\n" not in str(caught.value)
    with pytest.raises(ConfigError, match="bind"):
        ServerConfig.of(**BASE, bind=bind, token_file=token_file)
    with pytest.raises(ConfigError, match="bind"):
        ServerConfig.of(**BASE, bind=bind, tls_cert=certs.server_cert, tls_key=certs.server_key)
    ServerConfig.of(**BASE, bind=bind, insecure=True)
    ServerConfig.of(**BASE, bind=bind, tls_cert=certs.server_cert, tls_key=certs.server_key, token_file=token_file)


@pytest.mark.parametrize("bind", ["127.0.0.1", "127.0.0.2", "::1", "localhost"])
def test_loopback_binds_need_nothing(bind):
    ServerConfig.of(**BASE, bind=bind)


@pytest.mark.parametrize("fields,name", [
    (dict(tls_cert=Path("c.pem")), "tls_key"),
    (dict(tls_key=Path("k.pem")), "tls_cert"),
    (dict(tls_client_ca=Path("ca.pem")), "tls_client_ca"),
])
def test_tls_options_come_in_pairs(fields, name):
    with pytest.raises(ConfigError, match=name):
        ServerConfig.of(**BASE, **fields)


def test_unreadable_or_empty_token_and_certificate_files_fail_at_start(shards, tmp_path, certs):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    for path in (tmp_path / "missing", empty):
        with pytest.raises(ConfigError, match=f"token_file: .*{path.name}"):
            start({"sample": shards}, token_file=path)
    with pytest.raises(ConfigError, match="tls_key: .*nope"):
        start({"sample": shards}, tls_cert=certs.server_cert, tls_key=tmp_path / "nope")


def test_serve_refuses_an_open_bind_with_one_line(tmp_path):
    from typer.testing import CliRunner

    from cli.app import app

    result = CliRunner().invoke(app, ["serve", "--dataset", f"d={tmp_path}", "--bind", "0.0.0.0"])
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and line.startswith("feeder: error: bind: 0.0.0.0") and "--insecure" in line


# -- token ------------------------------------------------------------------------------

def test_calls_without_the_token_are_unauthenticated_but_health_stays_open(private_server, token_file):
    server, port = private_server(token_file=token_file)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        for metadata in ((), _bearer("wrong"), _bearer(TOKEN + "x"), (("authorization", TOKEN),)):
            with pytest.raises(grpc.RpcError) as caught:
                stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), metadata=metadata, timeout=10)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert "token" in caught.value.details()
        with pytest.raises(grpc.RpcError) as caught:
            next(stub.StreamBatches(request(), timeout=10))
        assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert server.service.open_streams() == 0
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), metadata=_bearer(TOKEN)).datasets
        batches = list(stub.StreamBatches(request(max_samples=10), metadata=_bearer(TOKEN)))
        assert [len(b.keys) for b in batches] == [5, 5]
        assert stub.GetStats(feeder_pb2.StatsRequest(), metadata=_bearer(TOKEN)).errors == 0
    assert server.metrics.registry.get_sample_value("feeder_unauthenticated_total") == 5


# -- TLS --------------------------------------------------------------------------------

def test_tls_serves_clients_that_trust_the_ca_and_refuses_plaintext(private_server, certs, token_file):
    _, port = private_server(tls_cert=certs.server_cert, tls_key=certs.server_key, token_file=token_file)
    with _tls_channel(port, certs) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        batches = list(stub.StreamBatches(request(max_samples=5), metadata=_bearer(TOKEN), timeout=30))
        assert len(batches) == 1
    with connect(port) as plain:
        with pytest.raises(grpc.RpcError) as caught:
            _health(plain)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_needs_a_client_certificate_signed_by_the_client_ca(private_server, certs):
    _, port = private_server(tls_cert=certs.server_cert, tls_key=certs.server_key, tls_client_ca=certs.ca)
    with _tls_channel(port, certs, client_cert=True) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert feeder_pb2_grpc.FeederStub(channel).ListDatasets(feeder_pb2.ListDatasetsRequest()).datasets
    with _tls_channel(port, certs, client_cert=False) as channel:
        with pytest.raises(grpc.RpcError) as caught:
            _health(channel)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


# -- unix socket ------------------------------------------------------------------------

def test_unix_socket_is_owner_only_and_serves(private_server, tmp_path):
    path = tmp_path / "feeder.sock"
    private_server(socket_path=path)
    mode = os.stat(path).st_mode
    assert stat.S_ISSOCK(mode) and stat.S_IMODE(mode) == 0o600
    with grpc.insecure_channel(f"unix:{path}", options=OPTIONS) as channel:
        batches = list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request(max_samples=10)))
        assert [len(b.keys) for b in batches] == [5, 5]


def test_a_stale_socket_file_is_replaced_but_another_file_is_refused(private_server, shards, tmp_path):
    import socket

    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # left behind, as by a daemon killed with -9
    private_server(socket_path=stale)
    assert stat.S_IMODE(os.stat(stale).st_mode) == 0o600
    other = tmp_path / "notes.txt"
    other.write_text("keep me")
    with pytest.raises(ConfigError, match="socket_path: .*notes.txt"):
        start({"sample": shards}, socket_path=other)
    assert other.read_text() == "keep me"


def test_a_second_daemon_on_a_live_socket_is_refused_and_the_first_keeps_it(private_server, shards, tmp_path):
    path = tmp_path / "feeder.sock"
    private_server(socket_path=path)
    with pytest.raises(ConfigError, match=f"socket_path: a daemon is serving on {path}") as caught:
        start({"sample": shards}, socket_path=path)
    assert "\n" not in str(caught.value)
    with grpc.insecure_channel(f"unix:{path}", options=OPTIONS) as channel:
        batches = list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request(max_samples=5), timeout=30))
        assert [len(b.keys) for b in batches] == [5]


def test_serve_on_a_live_socket_exits_with_one_line(private_server, shards, tmp_path):
    from typer.testing import CliRunner

    from cli.app import app

    path = tmp_path / "feeder.sock"
    private_server(socket_path=path)
    result = CliRunner().invoke(app, ["serve", "--dataset", f"sample={shards}", "--port", "0", "--device", "cpu",
                                      "--socket-path", str(path)])
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and line.startswith("feeder: error: socket_path: a daemon is serving on")
    assert stat.S_ISSOCK(os.stat(path).st_mode)


def test_a_peer_at_its_limit_does_not_lock_out_a_client_on_the_socket(private_server, tmp_path):
    path = tmp_path / "feeder.sock"
    server, port = private_server(socket_path=path, max_streams_per_peer=2, queue_batches=1)
    with connect(port) as tcp, grpc.insecure_channel(f"unix:{path}", options=OPTIONS) as local:
        flood = feeder_pb2_grpc.FeederStub(tcp)
        unread = [flood.StreamBatches(request(batch_size=16, image_size=128, epochs=20)) for _ in range(2)]
        deadline = time.monotonic() + 10
        while server.service.open_streams() < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(grpc.RpcError) as caught:
            next(flood.StreamBatches(request()))
        assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        batches = list(feeder_pb2_grpc.FeederStub(local).StreamBatches(request(max_samples=10)))
        assert [len(b.keys) for b in batches] == [5, 5]
        for call in unread:
            call.cancel()


# -- metrics endpoint -------------------------------------------------------------------

def test_metrics_listen_only_where_the_service_listens(private_server):
    server, _ = private_server(bind="127.0.0.2", metrics_port=0)
    text = urllib.request.urlopen(f"http://127.0.0.2:{server.metrics_port}/metrics", timeout=5).read()
    assert b"feeder_open_streams" in text
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=5)


# -- launcher ---------------------------------------------------------------------------

@pytest.mark.slow
def test_launcher_checks_health_of_a_tls_daemon(shards, certs, token_file):
    options = ("--device", "cpu", "--threads", "1", "--tls-cert", str(certs.server_cert),
               "--tls-key", str(certs.server_key), "--token-file", str(token_file))
    daemon = DaemonProcess({"sample": shards}, options, tls_root=certs.ca)
    port = int(daemon.start().rsplit(":", 1)[1])
    try:
        with _tls_channel(port, certs) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            assert stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), metadata=_bearer(TOKEN)).datasets
    finally:
        assert daemon.stop() == 0
