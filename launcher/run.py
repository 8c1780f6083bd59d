"""``feeder run [serve options] -- COMMAND ...``: the per-node launcher a training job
is wrapped in (under ``srun``, as a container's command, by hand).

It gives ``COMMAND`` this node's daemon, for as long as the command runs:

- the daemon already serving on the node's socket (or port) when there is one, so
  that a node's jobs share it; else one of its own, started with the serve options
  given and waited on until gRPC health says SERVING (a daemon that cannot start
  ends the launcher with its reason; the command never starts). A daemon already
  serving is shared only where it serves every dataset named with the identity the
  launcher's own directories and pixel options give (:mod:`launcher.shared_daemon`);
  else the launcher stops with one line naming both. Another launcher's daemon that
  takes the socket while this one's starts is shared in the same way (waited for
  while it starts), with one line saying so;
- ``FEEDER_ADDRESS`` (this node's daemon first, then ``--pool-with``),
  ``FEEDER_TOKEN`` and ``FEEDER_SHM_DIR`` (the daemon's own shared-memory directory)
  in the command's environment, which the loader and the trainer read when not
  given them;
- a daemon that dies started again (a bounded number of times, with a backoff, one
  line each; the loaders reconnect at their cursors). A shared daemon that stops
  answering (its launcher's job ended) is replaced by one of this launcher's own;
  one that another daemon replaced is checked again, with one line saying what
  differs if it no longer serves what the launcher would; what a daemon killed
  outright left (socket file, segments) is swept;
- SIGINT and SIGTERM passed on to the command; when it exits, the daemon this
  launcher started is stopped (SIGTERM, SIGKILL after ``--grace-s`` and 5 s more)
  and the launcher exits with the command's status (128 + N for signal N). A
  launcher killed outright takes its command with it (:mod:`launcher.guard`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from core.errors import ConfigError, FeederError, is_cli_message
from core.processes import limited
from feeder.config import ServerConfig
from feeder.security import read_token
from feeder.socket_claim import SocketClaim
from launcher.config import RunConfig
from launcher.daemon_process import DaemonProcess
from launcher.guard import LauncherGuard, sweep_leftovers
from launcher.shared_daemon import SharedDaemon

__all__ = ["ADDRESS_ENV", "SHM_DIR_ENV", "TOKEN_ENV", "NodeLauncher", "exit_status", "local_address"]

ADDRESS_ENV = "FEEDER_ADDRESS"
TOKEN_ENV = "FEEDER_TOKEN"
SHM_DIR_ENV = "FEEDER_SHM_DIR"
_WATCH_S = 0.5  # how often the daemon is looked at while the command runs
_SHARED_CHECK_S = 2.0  # how often a shared daemon is asked for its health
_SHARED_MISSES = 2  # health checks a shared daemon may miss before it is replaced
_BACKOFF_S = (1.0, 2.0, 4.0, 8.0, 16.0, 30.0)
_STOP_MARGIN_S = 5.0
_REPLACED = "its loaders will refuse it (FAILED_PRECONDITION); stop it, or run this job beside a daemon of its own"


def local_address(config: ServerConfig, port: int | None = None) -> str:
    """Where this node's ranks reach the daemon: its socket when it has one, else its
    port on the address it binds (loopback for a wildcard bind)."""
    if config.socket_path is not None:
        return f"unix:{Path(config.socket_path).resolve()}"
    host = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "[::1]"}.get(config.bind, config.bind)
    if ":" in host and not host.startswith("["):
        host = f"[{host}]"
    return f"{host}:{config.port if port is None else port}"


def exit_status(returncode: int) -> int:
    """A child's ``returncode`` as a shell reports it (signal N: 128 + N)."""
    return returncode if returncode >= 0 else 128 - returncode


def _serving(address: str, timeout_s: float = 1.0) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=timeout_s)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _say(text: str) -> None:
    print(f"feeder run: {text}", file=sys.stderr, flush=True)


def _claimed(socket_path: Path) -> bool:
    """Whether a daemon holds the claim on ``socket_path`` (serving there, or starting)."""
    claim = SocketClaim.take(socket_path)
    if claim is None:
        return True
    claim.release(remove_socket=False)
    return False


class _DaemonLines:
    """Where the output of the launcher's daemon goes: to stderr as it comes, but for,
    while it starts, the one line its CLI ends a failed start with. The launcher says
    why the start failed itself (its line quotes the daemon's), or that another
    daemon serves there instead: a line of the daemon's own would name a cause that
    is not the run's."""

    def __init__(self) -> None:
        self.starting = True

    def __call__(self, line: str) -> None:
        if not (self.starting and is_cli_message(line)):
            print(line, end="", file=sys.stderr, flush=True)


class NodeLauncher:
    """This node's daemon for one command's life (see the module's docstring).

    Args:
        config: the serve options and the launcher's own.
        serve_args: the ``feeder serve`` options as given (the launcher's own left out).
        command: what to run, with its arguments.
        say: where the launcher's lines go (stderr).
    """

    def __init__(self, config: RunConfig, serve_args: Sequence[str], command: Sequence[str],
                 say: Callable[[str], None] = _say) -> None:
        if not command:
            raise ConfigError("command: give it after --, e.g. feeder run --dataset d=shards -- torchrun ...")
        self.config = config
        self._serve_args = list(serve_args)
        self._command = list(command)
        self._say = say
        token_file = config.security.token_file
        self._token = read_token(token_file).decode() if token_file is not None else None
        self._port = config.port
        self.address = local_address(config)
        self.daemon: DaemonProcess | None = None  # the one this launcher started, if any
        self.restarts = 0
        self._next_start = 0.0
        self._gave_up = False
        self._child: subprocess.Popen[bytes] | None = None
        # The rings' directory the command is given: the launcher's, or a shared daemon's
        # (where a daemon of the launcher's own replacing that one then puts them too).
        self._shm_dir = Path(config.shm.shm_dir).resolve()
        self._guard: LauncherGuard | None = None
        self._shared: SharedDaemon | None = None  # what the shared daemon said it serves, as last checked

    @property
    def environment(self) -> dict[str, str]:
        """What the command finds in its environment besides the launcher's own."""
        found = {ADDRESS_ENV: ",".join([self.address, *self.config.pool_with]), SHM_DIR_ENV: str(self._shm_dir)}
        if self._token is not None:
            found[TOKEN_ENV] = self._token
        return found

    def run(self) -> int:
        """Start or find the daemon, run the command, stop the daemon; returns the
        command's exit status.

        Raises:
            ConfigError: no daemon could be had (its reason), or the command cannot run.
        """
        self._have_daemon()
        try:
            self._guard = LauncherGuard(self.config.grace_s + _STOP_MARGIN_S, self._shm_dir, self.config.socket_path)
            if self.daemon is not None:
                self._guard.daemon(self.daemon.pid)
            return self._run_command()
        finally:
            self._stop_daemon()
            if self._guard is not None:
                self._guard.close(command_ended=self._child is None or self._child.poll() is not None)

    @property
    def _known_address(self) -> bool:
        """Whether another launcher's daemon could be found where this one's would be."""
        return self.config.socket_path is not None or self.config.port != 0

    def _have_daemon(self) -> None:
        if self._known_address and _serving(self.address):
            self._use_shared()
            return
        try:
            self._start_daemon()
        except RuntimeError as e:
            if self._known_address and self._another_took_it():
                self._use_shared()
                return
            raise ConfigError(str(e)) from e

    def _another_took_it(self) -> bool:
        """Whether another daemon (another launcher's) took this node's address while
        this launcher's own was starting: serving there, or holding the socket and
        serving within ``start_timeout_s``."""
        if _serving(self.address):
            self._say(f"another daemon began serving on {self.address} while this launcher's own was starting")
            return True
        if self.config.socket_path is None or not _claimed(self.config.socket_path):
            return False
        self._say(f"another daemon took {self.address} while this launcher's own was starting; waiting up to "
                  f"{self.config.start_timeout_s:g} s for it to serve")
        deadline = time.monotonic() + self.config.start_timeout_s
        while time.monotonic() < deadline and _claimed(self.config.socket_path):
            if _serving(self.address):
                return True
            time.sleep(_WATCH_S)
        return _serving(self.address)

    def _use_shared(self) -> None:
        shared = SharedDaemon.ask(self.address, self._token)
        shared.check_datasets(self.config)
        self._shared = shared
        self._shm_dir = shared.shm_dir(self._shm_dir)
        self._say(f"using the daemon already serving on {self.address}")
        not_had = shared.options_not_had(self.config, self._serve_args)
        if not_had:
            self._say(f"the shared daemon keeps its own options; not applied: {', '.join(not_had)}")

    def _start_daemon(self) -> None:
        started = time.monotonic()
        health = self.address if self.config.socket_path is not None else None
        shm = () if self._shm_dir == Path(self.config.shm.shm_dir).resolve() else ("--shm-dir", str(self._shm_dir))
        lines = _DaemonLines()
        daemon = DaemonProcess({}, (*self._serve_args, *shm, "--port", str(self._port)), echo=lines,
                               start_timeout_s=self.config.start_timeout_s,
                               stop_timeout_s=self.config.grace_s + _STOP_MARGIN_S, die_with_parent=True,
                               health_address=health, new_session=True)
        daemon.start()
        lines.starting = False
        self.daemon = daemon
        if self._guard is not None:
            self._guard.daemon(daemon.pid)
        if self.config.socket_path is None:
            self._port = int(daemon.address.rsplit(":", 1)[1])  # port 0: the one it chose, kept for restarts
            self.address = local_address(self.config, self._port)
        self._say(f"daemon serving on {self.address} (pid {daemon.pid}), ready in "
                  f"{time.monotonic() - started:.1f} s")

    def _start_command(self) -> subprocess.Popen[bytes]:
        """The command, in a process group of its own, let run only once the guard
        knows that group (a launcher killed in between leaves no command behind)."""
        gate, let_run = os.pipe()
        try:
            child = subprocess.Popen(limited(self._command, gate_fd=gate), env=os.environ | self.environment,
                                     process_group=0, pass_fds=(gate,))
            if self._guard is not None:
                self._guard.command(child.pid)
            os.write(let_run, b"x")
        except OSError as e:
            raise ConfigError(f"command: cannot run {self._command[0]} ({e.strerror})") from e
        finally:
            os.close(gate)
            os.close(let_run)
        return child

    def _run_command(self) -> int:
        self._child = self._start_command()
        previous = {sig: signal.signal(sig, self._pass_on) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            misses, next_check = 0, time.monotonic() + _SHARED_CHECK_S
            while True:
                try:
                    returncode = self._child.wait(_WATCH_S)
                    break
                except subprocess.TimeoutExpired:
                    pass
                if self.daemon is None and time.monotonic() >= next_check:
                    misses = 0 if _serving(self.address) else misses + 1
                    if not misses:
                        self._check_shared()
                    next_check = time.monotonic() + _SHARED_CHECK_S
                if self.daemon is not None or misses >= _SHARED_MISSES:
                    self._keep_daemon()
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        return exit_status(returncode)

    def _check_shared(self) -> None:
        """Check the shared daemon again once it answers otherwise than the one shared
        (another daemon took its place): one line saying whether it serves what this
        launcher would, and what differs where it does not."""
        try:
            now: SharedDaemon | None = SharedDaemon.ask(self.address, self._token)
        except ConfigError as e:
            now, refused = None, str(e)
        before = self._shared.reply if self._shared is not None else None
        if (now.reply if now is not None else None) == before:  # the same daemon (or refused again)
            return
        self._shared = now
        if now is None:
            self._say(f"the daemon serving on {self.address} is not the one shared: {refused}")
            return
        try:
            now.check_datasets(self.config, then=_REPLACED)
        except FeederError as e:
            self._say(f"another daemon now serves on {self.address}, not what this launcher would: {e}")
            return
        rings = now.shm_dir(self._shm_dir)
        moved = f" (its rings are in {rings}; the command was given {self._shm_dir})" if rings != self._shm_dir else ""
        self._say(f"another daemon now serves on {self.address}; it serves the same datasets and pixels{moved}")

    def _pass_on(self, signum: int, _frame: FrameType | None) -> None:
        if self._child is not None and self._child.poll() is None:
            self._child.send_signal(signum)

    def _keep_daemon(self) -> None:
        """Start a daemon again if this node's is gone and the budget allows (after
        its backoff); a shared one that answers again is left to its launcher."""
        if self._gave_up or (self.daemon is not None and self.daemon.returncode is None):
            return
        if self.daemon is None and _serving(self.address):
            self._next_start = 0.0
            return
        if self.restarts >= self.config.restarts:
            gone = self._why(self.daemon) if self.daemon is not None else "the shared one stopped answering"
            self._say(f"the daemon is gone ({gone}) and was started again {self.restarts} times; not again")
            self._gave_up = True
            if self.daemon is not None:
                sweep_leftovers(self.config.socket_path, self._shm_dir)
            return
        now = time.monotonic()
        if self._next_start == 0.0:
            wait_s = _BACKOFF_S[min(self.restarts, len(_BACKOFF_S) - 1)]
            gone = self._why(self.daemon) if self.daemon is not None else "the shared one stopped answering"
            self._say(f"the daemon is gone ({gone}); starting one again in {wait_s:.0f} s "
                      f"(restart {self.restarts + 1} of {self.config.restarts})")
            self._next_start = now + wait_s
            return
        if now < self._next_start:
            return
        self._next_start = 0.0
        self.restarts += 1
        try:
            self._start_daemon()
        except RuntimeError as e:
            self._say(f"the daemon did not start again: {e}")

    @staticmethod
    def _why(daemon: DaemonProcess) -> str:
        code = daemon.returncode
        if code is None:
            return "running"
        if code < 0:
            try:
                return signal.Signals(-code).name
            except ValueError:
                return f"signal {-code}"
        return f"status {code}"

    def _stop_daemon(self) -> None:
        if self.daemon is None:
            return
        died = self.daemon.returncode is not None
        status = self.daemon.stop()
        # Killed before the launcher's SIGTERM, or by the SIGKILL after it: its socket and
        # segments are still there.
        if died or status < 0:
            sweep_leftovers(self.config.socket_path, self._shm_dir)
