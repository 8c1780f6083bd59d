"""Run ``feeder serve`` as a child process: start it on a free port, wait until it
listens and its health service says SERVING, stop it with SIGTERM. Used by the demo
and the benchmarks (tests run the daemon in-process with ``create_server``)."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.processes import limited

__all__ = ["DaemonProcess"]

_READY = "feeder: serving on "
_LOG_LINES = 20  # last lines of output kept to explain a failed start


class DaemonProcess:
    """A ``feeder serve`` child process (a context manager: started on enter,
    stopped on exit).

    Args:
        datasets: NAME -> shard directory (a path, or an object store URL).
        options: more ``feeder serve`` options, e.g. ``("--threads", "2")``.
        echo: called with each line the daemon prints (stdout and stderr), e.g. to
            show it prefixed; None keeps only the last lines for error messages.
        start_timeout_s: how long opening the shards and binding may take.
        stop_timeout_s: how long the daemon gets to exit after SIGTERM before SIGKILL.
        cwd: working directory of the child.
        tls_root: PEM file of the CA that signed the daemon's ``--tls-cert``, for the
            health check of a daemon serving TLS (the health check needs no token).
        die_with_parent: the daemon gets SIGKILL when the thread that started it
            ends (Linux), so a caller killed without a chance to stop it (a benchmark
            worker at its limit) leaves no daemon behind.
        health_address: where to ask the daemon's health (plaintext, e.g. its
            ``unix:`` socket); None: the address it prints.
        new_session: start it in a session of its own, so that a terminal's Ctrl-C
            (or a signal to the caller's process group) does not reach it.

    Attributes:
        address: ``host:port`` it listens on, once started.
    """

    def __init__(
        self,
        datasets: Mapping[str, Path | str],
        options: tuple[str, ...] = (),
        echo: Callable[[str], None] | None = None,
        start_timeout_s: float = 120.0,
        stop_timeout_s: float = 30.0,
        cwd: Path | None = None,
        tls_root: Path | None = None,
        die_with_parent: bool = False,
        health_address: str | None = None,
        new_session: bool = False,
    ) -> None:
        self.command = [sys.executable, "-m", "feeder", "serve", "--port", "0"]
        for name, path in datasets.items():
            self.command += ["--dataset", f"{name}={path}"]
        self.command += list(options)
        self.address = ""
        self._echo = echo
        self._start_timeout_s, self._stop_timeout_s = start_timeout_s, stop_timeout_s
        self._cwd = cwd
        self._tls_root = tls_root
        self._die_with_parent = die_with_parent
        self._health_address = health_address
        self._new_session = new_session
        self._log: deque[str] = deque(maxlen=_LOG_LINES)
        self._proc: subprocess.Popen[str] | None = None

    @property
    def pid(self) -> int:
        """Process id of the daemon (0 before start)."""
        return self._proc.pid if self._proc else 0

    def start(self) -> str:
        """Start the daemon and wait until it serves; returns its address.

        Raises:
            RuntimeError: it exited or did not become healthy in time (with its last
                lines of output).
        """
        self._proc = subprocess.Popen(limited(self.command, die_with_parent=self._die_with_parent), cwd=self._cwd,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=self._new_session)
        found: list[str] = []
        ready = threading.Event()
        threading.Thread(target=self._read_output, args=(found, ready), name="feeder-daemon-output",
                         daemon=True).start()
        if not ready.wait(self._start_timeout_s) or not found:
            self._kill()
            raise RuntimeError("feeder serve did not start: " + " | ".join(self._log))
        self.address = found[0]
        self._wait_healthy()
        return self.address

    def _read_output(self, found: list[str], ready: threading.Event) -> None:
        # Keeps draining for the daemon's whole life, so its pipe never fills.
        for line in self._proc.stdout:  # type: ignore[union-attr]
            self._log.append(line.rstrip())
            if self._echo is not None:
                self._echo(line)
            if line.startswith(_READY) and not found:
                found.append(line[len(_READY):].strip())
                ready.set()
        ready.set()  # exited before it was ready

    def _channel(self) -> grpc.Channel:
        if self._health_address is not None:
            return grpc.insecure_channel(self._health_address)
        if self._tls_root is None:
            return grpc.insecure_channel(self.address)
        credentials = grpc.ssl_channel_credentials(Path(self._tls_root).read_bytes())
        return grpc.secure_channel(self.address, credentials)

    def _wait_healthy(self) -> None:
        with self._channel() as channel:
            try:
                reply = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=self._start_timeout_s, wait_for_ready=True)
            except grpc.RpcError as e:
                self._kill()
                raise RuntimeError(f"feeder serve at {self.address} is not healthy: {e.code().name}") from e
        if reply.status != health_pb2.HealthCheckResponse.SERVING:
            self._kill()
            raise RuntimeError(f"feeder serve at {self.address} reports {reply.status}")

    def stop(self) -> int:
        """SIGTERM, wait up to ``stop_timeout_s`` (then SIGKILL); returns the exit status."""
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                return self._proc.wait(self._stop_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        return self._kill()

    @property
    def returncode(self) -> int | None:
        """The exit status once it has exited (negative: the signal), else None."""
        return None if self._proc is None else self._proc.poll()

    def kill(self) -> int:
        """SIGKILL at once (nothing cleaned up, as the OOM killer does); returns the exit status."""
        return self._kill()

    def _kill(self) -> int:
        if self._proc is None:
            return 0
        if self._proc.poll() is None:
            self._proc.kill()
        return self._proc.wait()

    def __enter__(self) -> DaemonProcess:
        self.start()
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
