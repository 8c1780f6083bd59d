"""The metrics endpoint: a bounded pool of threads however many clients are slow,
each connection given a fixed time in all, and the token when the daemon has one."""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.common.waiting import wait_for

TOKEN = "metrics-test-token"


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))  # every thread of this process, gRPC's C threads too


def _scrape(port: int, token: str | None = None, timeout_s: float = 5.0) -> tuple[int, bytes]:
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    req = urllib.request.Request(f"http://127.0.0.1:{port}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as e:
        return e.code, b""


def _slow_clients(port: int, count: int) -> list[socket.socket]:
    """Connections that send nothing, or half a request header, and wait."""
    clients = []
    for i in range(count):
        client = socket.create_connection(("127.0.0.1", port), timeout=10)
        if i % 2:
            client.sendall(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        clients.append(client)
    return clients


@pytest.mark.slow
def test_slow_clients_cannot_multiply_threads_and_a_scrape_answers(private_server):
    server, _ = private_server(metrics_port=0, metrics_threads=4, metrics_timeout_s=1.0)
    assert _scrape(server.metrics_port)[0] == 200
    before = _threads()
    clients = _slow_clients(server.metrics_port, 300)
    try:
        peak = before
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            peak = max(peak, _threads())
            time.sleep(0.01)
        assert peak <= before + 2, f"{peak - before} threads more with 300 slow clients"
        ours = [name for name in _thread_names() if name.startswith("feeder-metrics")]
        assert len(ours) == 4 + 2, ours  # the pool, the accept loop, the deadlines
        # Among the slow ones, behind them: answered once they are cut off at their
        # 1 s deadline (its own 10 s timeout says it was not left waiting for ever).
        status, body = _scrape(server.metrics_port, timeout_s=10)
        assert status == 200 and b"feeder_open_streams" in body
    finally:
        for client in clients:
            client.close()
    assert _threads() <= before + 2
    assert server.metrics.registry.get_sample_value("feeder_metrics_scrapes_refused_total", {"reason": "busy"}) > 0


@pytest.mark.slow
def test_a_slow_client_is_cut_off_however_slowly_it_trickles(private_server):
    server, _ = private_server(metrics_port=0, metrics_timeout_s=1.0)
    with socket.create_connection(("127.0.0.1", server.metrics_port), timeout=10) as client:
        started = time.monotonic()
        ended = False
        while time.monotonic() - started < 60 and not ended:
            try:
                client.sendall(b"X")  # one byte every 0.2 s: each read comes within any per-read timeout
                time.sleep(0.2)
            except OSError:
                ended = True
        # Each byte comes within any per-read timeout: only the connection's own
        # deadline (1 s) ends it; the minute tried is a wait, however slow the machine.
        assert ended, "a connection that never finishes its header is closed"


@pytest.fixture()
def token_file(tmp_path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def test_with_a_token_scrapes_must_carry_it(private_server, token_file):
    server, _ = private_server(metrics_port=0, token_file=token_file)
    assert _scrape(server.metrics_port)[0] == 401
    assert _scrape(server.metrics_port, "wrong")[0] == 401
    status, body = _scrape(server.metrics_port, TOKEN)
    assert status == 200 and b"feeder_open_streams" in body
    assert server.metrics.registry.get_sample_value("feeder_metrics_scrapes_refused_total", {"reason": "token"}) == 2


def test_metrics_threads_end_with_the_daemon(private_server):
    server, _ = private_server(metrics_port=0)
    assert _scrape(server.metrics_port)[0] == 200
    server.stop(0).wait(10)
    assert wait_for(lambda: not any(t.startswith("feeder-metrics") for t in _thread_names()))


def _thread_names() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate()]


def test_a_metrics_port_in_use_is_one_line_naming_it(shards):
    from core.errors import ConfigError
    from feeder.config import ServerConfig
    from feeder.server import create_server

    with socket.socket() as taken:  # node-exporter's 9100, say
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        config = ServerConfig.of(datasets={"sample": shards}, port=0, device="cpu", threads=1, metrics_port=port)
        with pytest.raises(ConfigError, match=rf"^metrics_port: cannot listen on {port} \("):
            create_server(config)
