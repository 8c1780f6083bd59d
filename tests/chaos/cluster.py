"""What a fault-schedule run runs on, and how each fault is made: a real S3 server
(SeaweedFS) holding the dataset (and another one, for the daemon restarted on another
manifest), three ``feeder serve`` daemons on fixed ports reading it (and, where the
run streams a mix, a second dataset from local disk), and the ranks' control
directory. Every fault returns the evidence that it took place (an exit
status, a process state, what the store answers, a counter), which the run records:
a fault test proves its fault happened."""

from __future__ import annotations

import os
import random
import signal
import socket
import time
import urllib.request
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

from bench.seaweedfs import SeaweedFS
from launcher.daemon_process import DaemonProcess
from shards.objects import ObjectUrl
from shards.store import ObjectStore, StoreOptions
from tests.chaos.schedule import Fault, Kind

__all__ = ["Cluster", "free_port", "tell"]

DATASET = "sample"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def tell(control: Path, name: str, text: str) -> None:
    """Write a control file the ranks read, whole or not at all (a rank that read half
    of "14" as "1" stopped an epoch early)."""
    temporary = control / f".{name}.tmp"
    temporary.write_text(text)
    os.replace(temporary, control / name)


def _state(pid: int) -> str:
    """The process's state letter (``T`` stopped, ``S`` sleeping...)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


class Cluster:
    """The store, the daemons and the ranks' control directory of one run.

    Args:
        store: the S3 server, started.
        url: the dataset's URL in it; ``other``: another dataset's (another manifest).
        control: the ranks' control directory.
        daemon_options: more ``feeder serve`` options for every daemon.
        seed: for the choices a fault makes (which object to damage).
        local: more datasets every daemon serves, by name (a mix's, from local disk).
    """

    def __init__(self, store: SeaweedFS, url: str, other: str, control: Path, daemon_options: tuple[str, ...],
                 seed: int, local: dict[str, Path] | None = None) -> None:
        self.store, self.url, self.other, self.control = store, url, other, control
        self.local = dict(local or {})
        self._options = daemon_options
        self._rng = random.Random(seed)
        self.ports = [free_port() for _ in range(3)]
        self.metrics_ports = [free_port() for _ in range(3)]
        self.daemons: list[DaemonProcess | None] = [None, None, None]
        self.serving = [url, url, url]

    @property
    def addresses(self) -> list[str]:
        return [f"127.0.0.1:{port}" for port in self.ports]

    # -- daemons -------------------------------------------------------------------------
    def start_daemon(self, number: int) -> None:
        options = ("--port", str(self.ports[number]), "--metrics-port", str(self.metrics_ports[number]),
                   "--s3-endpoint", self.store.endpoint_url, *self._options)
        log = self.control.parent / f"daemon-{number}.log"

        def echo(line: str) -> None:
            with open(log, "a") as out:
                out.write(line)

        daemon = DaemonProcess({DATASET: self.serving[number], **self.local}, options, echo=echo, start_timeout_s=120,
                               stop_timeout_s=20)
        daemon.start()
        self.daemons[number] = daemon

    def stop_all(self) -> None:
        for daemon in self.daemons:
            if daemon is not None:
                daemon.stop()

    def idle_cancels(self) -> int:
        """Streams the daemons cancelled for idleness, all together (their metrics)."""
        total = 0
        for port in self.metrics_ports:
            try:
                text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            except OSError:
                continue
            for line in text.splitlines():
                if line.startswith("feeder_streams_idle_cancelled_total"):
                    total += int(float(line.split()[-1]))
        return total

    # -- the faults ------------------------------------------------------------------------
    def make(self, fault: Fault) -> str:
        """Make ``fault``, wait it out, put it right; the evidence it took place."""
        act = {
            Kind.DAEMON_KILLED: self._daemon_killed, Kind.DAEMON_STOPPED: self._daemon_stopped,
            Kind.DAEMON_RESTARTED: self._daemon_restarted, Kind.DAEMON_OTHER_MANIFEST: self._other_manifest,
            Kind.CONSUMER_PAUSED: self._consumer_paused, Kind.STORE_STOPPED: self._store_stopped,
            Kind.STORE_KILLED: self._store_killed, Kind.OBJECT_DAMAGED: self._object_damaged,
            Kind.CREDENTIALS_ROTATED: self._credentials_rotated,
        }[fault.kind]
        return act(fault)

    def _daemon(self, number: int) -> DaemonProcess:
        daemon = self.daemons[number]
        if daemon is None:
            raise RuntimeError(f"daemon {number} is not running")
        return daemon

    def _daemon_killed(self, fault: Fault) -> str:
        daemon = self._daemon(fault.target)
        os.kill(daemon.pid, signal.SIGKILL)
        status = daemon.stop()
        time.sleep(fault.duration_s)
        self.start_daemon(fault.target)
        return f"exit status {status}, restarted"

    def _daemon_stopped(self, fault: Fault) -> str:
        daemon = self._daemon(fault.target)
        os.kill(daemon.pid, signal.SIGSTOP)
        time.sleep(0.1)  # the signal is delivered asynchronously
        state = _state(daemon.pid)
        time.sleep(fault.duration_s)
        os.kill(daemon.pid, signal.SIGCONT)
        return f"state {state} while stopped"

    def _daemon_restarted(self, fault: Fault) -> str:
        status = self._daemon(fault.target).stop()
        self.start_daemon(fault.target)
        return f"exit status {status} after SIGTERM, restarted"

    def _other_manifest(self, fault: Fault) -> str:
        status = self._daemon(fault.target).stop()
        self.serving[fault.target] = self.other
        self.start_daemon(fault.target)
        return f"exit status {status}, restarted on {self.other}"

    def _consumer_paused(self, fault: Fault) -> str:
        before = self.idle_cancels()
        tell(self.control, "pause", str(time.time() + fault.duration_s))
        time.sleep(fault.duration_s + 1.0)
        return f"{self.idle_cancels() - before} streams cancelled for idleness"

    def _store_pids(self) -> int:
        process = self.store._process  # noqa: SLF001 - its process group is the store
        if process is None:
            raise RuntimeError("the store is not running")
        return process.pid

    def _store_stopped(self, fault: Fault) -> str:
        pid = self._store_pids()
        os.killpg(pid, signal.SIGSTOP)
        time.sleep(0.1)
        state = _state(pid)
        time.sleep(fault.duration_s)
        os.killpg(pid, signal.SIGCONT)
        return f"state {state} while stopped"

    def _store_killed(self, fault: Fault) -> str:
        pid = self._store_pids()
        self.store.stop(kill=True)
        gone = not Path(f"/proc/{pid}").exists() or _state(pid) == "Z"
        time.sleep(fault.duration_s)
        self.store.start()
        return f"killed ({'gone' if gone else 'still there'}), restarted"

    def _objects(self) -> ObjectStore:
        return ObjectStore(ObjectUrl.parse(self.url), StoreOptions(endpoint_url=self.store.endpoint_url,
                                                                  retry_window_s=30))

    def _object_damaged(self, fault: Fault) -> str:
        objects = self._objects()
        tars = sorted(name for name in objects.listing("train") if name.endswith(".tar"))
        name = self._rng.choice(tars)
        data = objects.read_bytes(name)
        before = objects.head(name).etag
        objects.delete([name])
        missing = name not in objects.listing("train")
        time.sleep(fault.duration_s)
        objects.put_bytes(name, bytes(b ^ 0xA5 for b in data))
        corrupt = objects.head(name)
        time.sleep(fault.duration_s)
        objects.put_bytes(name, data)
        return (f"{name}: {'missing' if missing else 'still listed'}, then {corrupt.size} bytes with ETag "
                f"{'changed' if corrupt.etag != before else 'unchanged'}, then put back")

    def _credentials_rotated(self, fault: Fault) -> str:
        keys = self.store.access_key, self.store.secret_key
        self.store.rotate_credentials("rotated", "rotated-secret")
        refused = "not refused"
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and refused == "not refused":
            try:
                self._objects().get_range("manifest.json", 0, 1)
                time.sleep(0.1)
            except Exception as e:  # noqa: BLE001 - the evidence is the refusal
                refused = f"refused ({type(e).__name__})"
        time.sleep(fault.duration_s)
        self.store.rotate_credentials(*keys)
        return f"the daemons' keys {refused}, then restored"


@contextmanager
def daemons_up(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster's three daemons started (at once), stopped on exit."""
    with ExitStack() as stack, ThreadPoolExecutor(3) as starting:
        stack.callback(cluster.stop_all)
        for started in [starting.submit(cluster.start_daemon, n) for n in range(3)]:
            started.result()
        yield cluster
