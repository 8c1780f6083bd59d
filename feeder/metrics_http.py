"""The Prometheus endpoint: ``/metrics`` over HTTP from a bounded pool of threads.

prometheus_client's own server starts a thread per connection and waits for a
request header as long as the client likes, so slow clients multiply threads.
Here a fixed pool serves connections in turn, each connection has ``timeout_s`` in
all from its accept (its socket is shut at the deadline, however slowly its bytes
trickle in), past a bound of waiting connections the oldest is closed, and with a token
a scrape must carry ``Authorization: Bearer <token>`` (Prometheus'
``authorization`` setting), else 401.
"""

from __future__ import annotations

import functools
import hmac
import logging
import socket
import socketserver
import threading
import time
from collections import deque
from typing import Any

from prometheus_client import CollectorRegistry, MetricsHandler

from feeder.deadlines import Deadline, Deadlines
from feeder.metrics import ServerMetrics

log = logging.getLogger(__name__)

__all__ = ["MetricsEndpoint"]

_PENDING_PER_THREAD = 16  # accepted connections waiting for a thread, per thread, before the oldest is closed


class _Handler(MetricsHandler):
    """prometheus_client's handler, behind the token when there is one."""

    registry: CollectorRegistry
    expected: bytes | None  # b"Bearer <token>", or None for no token
    metrics: ServerMetrics

    def do_GET(self) -> None:  # noqa: N802 - http.server's method name
        if self.expected is not None:
            sent = self.headers.get("Authorization", "").encode("latin-1", "replace")
            if not hmac.compare_digest(sent, self.expected):
                self.metrics.scrape_refused("token")
                self.send_response(401)
                self.send_header("WWW-Authenticate", 'Bearer realm="feeder"')
                self.send_header("Content-Length", "0")
                self.end_headers()
                return
        super().do_GET()


class _PooledServer(socketserver.TCPServer):
    """A TCP server whose accepted connections wait in a bounded queue for one of
    ``threads`` threads, each with a deadline counted from its accept; when the queue
    is full the oldest waiting connection is closed (the likeliest to be a slow one),
    so a scrape arriving last is served once a thread frees."""

    allow_reuse_address = True
    request_queue_size = 128  # listen backlog: a burst of connections is accepted (and closed) rather than dropped

    def __init__(self, address: tuple[str, int], family: socket.AddressFamily, handler: type[_Handler],
                 threads: int, timeout_s: float, metrics: ServerMetrics) -> None:
        self.address_family = family
        # All set before binding: a port in use makes socketserver call server_close().
        self._deadlines = Deadlines("feeder-metrics-deadlines")
        self._timeout_s, self._metrics = timeout_s, metrics
        self._max_pending = threads * _PENDING_PER_THREAD
        self._pending: deque[tuple[Any, Any, Deadline, float]] = deque()
        self._ready = threading.Condition()
        self._closing = False
        self._workers: list[threading.Thread] = []
        super().__init__(address, handler)
        self._workers = [threading.Thread(target=self._work, name=f"feeder-metrics-{i}", daemon=True)
                         for i in range(threads)]
        for worker in self._workers:
            worker.start()

    def process_request(self, request: Any, client_address: Any) -> None:
        deadline = self._deadlines.add(self._timeout_s, functools.partial(_shut, request))
        with self._ready:
            dropped = self._pending.popleft() if len(self._pending) >= self._max_pending else None
            self._pending.append((request, client_address, deadline, time.monotonic()))
            self._ready.notify()
        if dropped is not None:
            self._metrics.scrape_refused("busy")
            self._end(dropped[0], dropped[2])

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._pending and not self._closing:
                    self._ready.wait()
                if self._closing:
                    return
                request, client_address, deadline, accepted_s = self._pending.popleft()
            try:
                if time.monotonic() - accepted_s < self._timeout_s:  # else its socket is shut already
                    self.finish_request(request, client_address)
            except OSError as e:  # the client went away, or its time ran out
                log.debug("metrics connection from %s ended: %s", client_address[0], e)
            except Exception as e:  # noqa: BLE001 - one bad connection must not end a serving thread
                log.warning("metrics connection from %s failed: %s: %s", client_address[0], type(e).__name__, e)
            finally:
                self._end(request, deadline)

    def _end(self, request: Any, deadline: Deadline) -> None:
        self._deadlines.clear(deadline)
        self.shutdown_request(request)

    def handle_error(self, request: Any, client_address: Any) -> None:
        """One line, not socketserver's traceback on stderr."""
        log.debug("metrics connection from %s dropped", client_address[0])

    def server_close(self) -> None:
        super().server_close()
        with self._ready:
            self._closing = True
            left = list(self._pending)
            self._pending.clear()
            self._ready.notify_all()
        for request, _, deadline, _ in left:
            self._end(request, deadline)
        for worker in self._workers:
            worker.join(timeout=self._timeout_s + 1)
        self._deadlines.close()


def _shut(connection: socket.socket) -> None:
    """End a connection past its deadline: a thread blocked reading it wakes up."""
    try:
        connection.shutdown(socket.SHUT_RDWR)
    except OSError:  # already closed by its client
        pass


class MetricsEndpoint:
    """Serves ``registry`` on ``http://address:port/metrics`` until ``close``.

    Args:
        metrics: the daemon's counters (served, and counting refused scrapes).
        address: host to bind.
        port: TCP port; 0 picks a free one.
        threads: connections served at once.
        timeout_s: seconds a connection may take in all, from its accept.
        token: the token scrapes must carry, or None.

    Raises:
        OSError: the port cannot be bound.
    """

    def __init__(self, metrics: ServerMetrics, address: str, port: int, threads: int, timeout_s: float,
                 token: bytes | None) -> None:
        handler = type("FeederMetricsHandler", (_Handler,), {
            "registry": metrics.registry, "metrics": metrics, "timeout": timeout_s,
            "expected": None if token is None else b"Bearer " + token,
        })
        family = socket.getaddrinfo(address, port, type=socket.SOCK_STREAM)[0][0]
        self._server = _PooledServer((address, port), family, handler, threads, timeout_s, metrics)
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="feeder-metrics-accept",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop accepting, close the socket and the pool."""
        self._server.shutdown()
        self._server.server_close()
