"""Building and running a daemon: ``create_server`` (in-process, started, for tests
and embedding) and ``serve`` (the ``feeder serve`` process: blocks until SIGTERM)."""

from __future__ import annotations

import logging
import signal
import sys
import threading
from concurrent import futures
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from core.errors import ConfigError, DataError
from decode.registry import AUTO, DECODERS, cpu_decoder_in_use, cpu_decoders
from feeder.call_guard import CallGuard
from feeder.config import ServerConfig
from feeder.log_lines import LineLimitFilter
from feeder.metrics import ServerMetrics
from feeder.metrics_http import MetricsEndpoint
from feeder.remote import close_remote, remote_access
from feeder.security import TokenInterceptor, listen_on_socket, read_token, server_credentials
from feeder.service import FeederService, open_datasets
from feeder.servicer import FeederServicer, add_to_server
from feeder.socket_claim import SocketClaim
from protos import feeder_pb2
from transport.shm import sweep_stale

log = logging.getLogger(__name__)

__all__ = ["FeederServer", "create_server", "format_address", "serve", "verify_datasets"]

SERVICE_NAME = feeder_pb2.DESCRIPTOR.services_by_name["Feeder"].full_name


def format_address(host: str, port: int) -> str:
    """``host:port``, with brackets around an IPv6 host."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def verify_datasets(config: ServerConfig) -> None:
    """``--verify-on-start``: check every dataset as ``feeder verify`` does.

    Raises:
        DataError: the first problem found, naming the dataset and the file, with the
            count of the others (``feeder verify`` lists them all).
    """
    from sharder.config import VerifyConfig  # the checks load only when asked for
    from sharder.verify import verify

    for name, root in config.datasets.items():
        result = verify(VerifyConfig(root, progress=False, s3_endpoint=config.remote.s3_endpoint))
        if result.problems:
            more = len(result.problems) - 1
            others = f" (and {more} more problem(s): feeder verify {root})" if more else ""
            raise DataError(f"verify_on_start: dataset {name}: {result.problems[0]}{others}")
        log.info("dataset %s: %s", name, result.summary())


class FeederServer:
    """A daemon: a ``grpc.Server`` with the feeder, health and reflection services,
    the plain-Python service behind them and the metrics endpoint; ``stop`` releases
    all of them.

    Attributes:
        service: the plain-Python service (open streams, pipeline pool).
        metrics: the daemon's counters (``metrics.registry`` for Prometheus).
        metrics_port: bound Prometheus port, or None.
    """

    def __init__(self, config: ServerConfig) -> None:
        self.config = config
        self.metrics = ServerMetrics()
        # Files first: a bad certificate or token stops the start before anything runs.
        self._credentials = server_credentials(config)
        self._token = None if config.security.token_file is None else read_token(config.security.token_file)
        # The token is checked first: a call without it is refused before it may wait.
        self._guard = CallGuard(config.calls.max_waiting_calls, config.calls.first_message_timeout_s, self.metrics)
        self._token_check = [] if self._token is None else [TokenInterceptor(self._token, self.metrics)]
        remote = remote_access(config)
        try:
            datasets = open_datasets(config.datasets, remote, tuple(Path(d) for d in config.allow_shard_links))
            if config.verify_on_start:
                verify_datasets(config)
        except BaseException:
            close_remote(remote)
            raise
        # Rings left by daemons that died (logged by the sweep), once the datasets are
        # known good: a start refused for its input touches nothing and says one line.
        sweep_stale(config.shm.shm_dir)
        self.service = FeederService(config, datasets, self.metrics, remote)
        self.health = health.HealthServicer()
        # Calls waiting for their request hold threads of their own: the gate keeps
        # them to max_waiting_calls, so worker_threads stay free for the others.
        threads = config.worker_threads + config.calls.max_waiting_calls
        self._grpc = grpc.server(
            futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="feeder-rpc"),
            interceptors=[*self._token_check, self._guard],
            options=[("grpc.so_reuseport", 0)],
        )
        add_to_server(FeederServicer(self.service), self._grpc)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self._grpc
        )
        self._http: MetricsEndpoint | None = None
        self.metrics_port: int | None = None
        self._socket: SocketClaim | None = None  # held from before the socket is bound until stopped

    def bind(self) -> int:
        """Listen on the configured address (TLS when configured) and unix socket;
        returns the bound port."""
        address = format_address(self.config.bind, self.config.port)
        try:
            if self._credentials is None:
                port = self._grpc.add_insecure_port(address)
            else:
                port = self._grpc.add_secure_port(address, self._credentials)
        except RuntimeError as e:
            raise ConfigError(f"port: cannot listen on {address} ({e})") from e
        if port == 0:
            raise ConfigError(f"port: cannot listen on {address}")
        if self.config.socket_path is not None:
            self._socket = listen_on_socket(self._grpc, self.config.socket_path)
        if self.config.metrics_port is not None:
            self._http = self._serve_metrics(self.config.metrics_port)
            self.metrics_port = self._http.port
        return port

    def _serve_metrics(self, port: int) -> MetricsEndpoint:
        c = self.config
        try:
            return MetricsEndpoint(self.metrics, c.bind, port, c.calls.metrics_threads, c.calls.metrics_timeout_s,
                                  self._token)
        except OSError as e:
            raise ConfigError(f"metrics_port: cannot listen on {port} ({e})") from e

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
            self._guard.close()
            for check in self._token_check:
                check.flush()
            if self._http is not None:
                self._http.close()
            self.release_socket()
            done.set()

        threading.Thread(target=finish, name="feeder-stop", daemon=True).start()
        return done

    def wait_for_termination(self, timeout: float | None = None) -> bool:
        return self._grpc.wait_for_termination(timeout)

    def release_socket(self) -> None:
        """Give up the unix socket's claim, removing the socket if the server left it
        (one bound but never started). Call once gRPC no longer serves on it."""
        if self._socket is not None:
            self._socket.release()


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
    try:
        port = server.bind()
    except ConfigError:
        server.release_socket()
        server.service.close()
        raise
    server.start()
    return server, port


def serve(config: ServerConfig) -> None:
    """Run a daemon until SIGTERM or SIGINT, then shut down within ``grace_s``.

    Prints ``feeder: serving on HOST:PORT`` (flushed) once listening, so a parent
    process can read the port when it asked for port 0.
    """
    logging.basicConfig(level=config.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    for output in logging.getLogger().handlers:
        output.addFilter(LineLimitFilter())  # no client input makes a line longer than this
    # Taken before the server starts: a launcher may send SIGTERM as soon as health says
    # SERVING, and the default action would end the daemon with its socket still bound.
    stop = threading.Event()
    previous = {s: signal.signal(s, lambda *_: stop.set()) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        _serve_until(config, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _log_cpu_decoder(choice: str) -> None:
    """One line: what decodes JPEG windows on the CPU, and why the ones before it in
    the registry's order do not where ``auto`` passed them over."""
    in_use = cpu_decoder_in_use(choice)
    names = cpu_decoders()[1:]
    passed = [f"{name}: {DECODERS[name].unavailable_reason()}" for name in names[:names.index(in_use)]]
    why = "asked for" if choice != AUTO else "; ".join(passed) or "the first of the registry's"
    log.info("CPU pipelines decode JPEG windows with %s (%s)", in_use, why)


def _serve_until(config: ServerConfig, stop: threading.Event) -> None:
    server, port = create_server(config)
    # The one line on stdout: launchers read the port from it.
    print(f"feeder: serving on {format_address(config.bind, port)}", flush=True)
    names = ", ".join(f"{n} ({'/'.join(d.splits)})" for n, d in sorted(server.service.datasets.items()))
    log.info("serving datasets %s on %s; device %s", names, format_address(config.bind, port),
             server.service.device)
    _log_cpu_decoder(config.decoding.cpu_decoder)
    if server.metrics_port is not None:
        log.info("metrics on http://%s/metrics", format_address(config.bind, server.metrics_port))
    security, budgets, tuning = config.security, config.budgets, config.tuning
    log.info("gRPC port: %s, %s; budget %.1f GiB, %d streams per peer, idle timeout %g s, %d decode threads%s "
             "shared %s", "TLS" + (" with client certificates" if security.tls_client_ca else "")
             if security.tls_cert else "plaintext", "token required" if security.token_file else "no token",
             budgets.max_memory_bytes / (1 << 30), budgets.max_streams_per_peer, budgets.idle_timeout_s,
             tuning.decode_threads, " (tuned)" if tuning.autotune and not tuning.threads else "", tuning.fair_share)
    if config.socket_path is not None:
        log.info("also serving on unix:%s (mode 0600)", config.socket_path)
    while not stop.wait(timeout=1.0):
        pass
    log.info("shutting down: streams get %.1f s to finish", config.grace_s)
    server.stop(config.grace_s).wait()
    log.info("stopped")
