"""Building and running a daemon: ``create_server`` (in-process, started, for tests
and embedding) and ``serve`` (the ``feeder serve`` process: blocks until SIGTERM)."""

from __future__ import annotations

import signal
import sys
import threading
from concurrent import futures
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from feeder.config import ServerConfig
from feeder.errors import ConfigError
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from feeder.servicer import FeederServicer, add_to_server
from protos import feeder_pb2

__all__ = ["FeederServer", "create_server", "format_address", "serve"]

SERVICE_NAME = feeder_pb2.DESCRIPTOR.services_by_name["Feeder"].full_name


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class FeederServer(grpc.Server):
    """A started ``grpc.Server`` that also owns the daemon's service, health status
    and metrics endpoint; ``stop`` releases all of them.

    Attributes:
        service: the plain-Python service (open streams, pipeline pool).
        metrics: the daemon's counters (``metrics.registry`` for Prometheus).
        metrics_port: bound Prometheus port, or None.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        self.service = FeederService(config, open_datasets(config.datasets), self.metrics)
        self.health = health.HealthServicer()
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=config.worker_threads, thread_name_prefix="feeder-rpc"),
            options=[("grpc.so_reuseport", 0)],
        )
        add_to_server(FeederServicer(self.service), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc
        )
        self._http: Any = None
        self.metrics_port: int | None = None

    def bind(self) -> int:
        """Listen on the configured address; returns the bound port."""
        address = format_address(self.config.bind, self.config.port)
        try:
            port = self._grpc.add_insecure_port(address)
        except RuntimeError as e:
            raise ConfigError(f"port: cannot listen on {address} ({e})") from e
        if port == 0:
            raise ConfigError(f"port: cannot listen on {address}")
        if self.config.metrics_port is not None:
            try:
                self._http, self.metrics_port = self.metrics.serve_http(
                    self.config.metrics_port, self.config.bind
                )
            except OSError as e:
                raise ConfigError(f"metrics_port: cannot listen on {self.config.metrics_port} ({e})") from e
        return port

    def start(self) -> None:
        self._grpc.start()
        for name in ("", SERVICE_NAME):
            self.health.set(name, health_pb2.HealthCheckResponse.SERVING)

    def stop(self, grace: float | None) -> threading.Event:
        """Refuse new streams, let in-flight ones run up to ``grace`` seconds, cancel
        the rest, release pipelines and the metrics endpoint. Returns an event set
        when all of that is done."""
        self.health.enter_graceful_shutdown()
        self.service.stop_accepting()
        stopped = self._grpc.stop(grace)
        done = threading.Event()

        def finish() -> None:
            stopped.wait()
            self.service.close()
            if self._http is not None:
                self._http.shutdown()
                self._http.server_close()
            done.set()

        threading.Thread(target=finish, name="feeder-stop", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._grpc.wait_for_termination(timeout)

    def add_generic_rpc_handlers(self, generic_rpc_handlers) -> None:  # type: ignore[no-untyped-def]
        self._grpc.add_generic_rpc_handlers(generic_rpc_handlers)

    def add_registered_method_handlers(self, service_name, method_handlers) -> None:  # type: ignore[no-untyped-def]
        self._grpc.add_registered_method_handlers(service_name, method_handlers)

    def add_insecure_port(self, address: str) -> int:
        return self._grpc.add_insecure_port(address)

    def add_secure_port(self, address: str, server_credentials: grpc.ServerCredentials) -> int:
        return self._grpc.add_secure_port(address, server_credentials)


def create_server(config: ServerConfig) -> tuple[FeederServer, int]:
    """Open the datasets, bind and **start** a daemon.

    Args:
        config: what to serve; ``port=0`` picks a free port.

    Returns:
        (the started server, the bound port). Call ``server.stop(grace)`` to end it.

    Raises:
        NotFound / DataError: a dataset path is missing or not valid shards.
        ConfigError: the port cannot be bound.
    """
    server = FeederServer(config)
    port = server.bind()
    server.start()
    return server, port


def serve(config: ServerConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut down within ``grace_s``.

    Prints ``feeder: serving on HOST:PORT`` (flushed) once listening, so a parent
    process can read the port when it asked for port 0.
    """
    server, port = create_server(config)
    print(f"feeder: serving on {format_address(config.bind, port)}", flush=True)
    names = ", ".join(f"{n} ({'/'.join(d.splits)})" for n, d in sorted(server.service.datasets.items()))
    print(f"feeder: datasets {names}; device {server.service.device}", flush=True)
    if server.metrics_port is not None:
        print(f"feeder: metrics on http://{format_address(config.bind, server.metrics_port)}/metrics", flush=True)
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while not stop.wait(timeout=1.0):
            pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("feeder: shutting down", file=sys.stderr, flush=True)
    server.stop(config.grace_s).wait()
    print("feeder: stopped", file=sys.stderr, flush=True)
