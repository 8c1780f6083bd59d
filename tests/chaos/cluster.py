"""What a fault-schedule run runs on, and how each fault is made: a real S3 server
(SeaweedFS) holding the dataset (and another one, for the daemon restarted on another
manifest), three ``feeder serve`` daemons on fixed ports reading it (and, where the
run streams a mix, a second dataset from local disk), and the ranks' control
directory. Every fault returns what was measured while it was made (an exit
status, process states, what the store answers, a counter: :mod:`tests.chaos.evidence`),
which the run checks with the predicate of its kind: a fault test proves its fault
happened."""

from __future__ import annotations

import os
import random
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from pathlib import Path

import grpc

from bench.seaweedfs import SeaweedFS, free_ports
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc
from shards.objects import ObjectMissing, ObjectUrl, StoreRefused
from shards.store import ObjectStore, StoreOptions
from tests.chaos.evidence import (
    ACCEPTED,
    STOPPED,
    Evidence,
    IdleCancels,
    KeysRotated,
    ObjectDamage,
    ProcessEnded,
    ProcessesStopped,
    StoreKilled,
)
from tests.chaos.schedule import Fault, Kind
from tests.common.waiting import wait_for

__all__ = ["Cluster", "tell"]

_PAUSE_HELD_S = 60.0  # the longest a consumer pause waits for the daemons' idle cancel

DATASET = "sample"


def tell(control: Path, name: str, text: str) -> None:
    """Write a control file the ranks read, whole or not at all (a rank that read half
    of "14" as "1" stopped an epoch early)."""
    temporary = control / f".{name}.tmp"
    temporary.write_text(text)
    os.replace(temporary, control / name)


def _state(pid: int) -> str:
    """The process's state letter (``T`` stopped, ``S`` sleeping, ``Z`` a zombie...),
    "" once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return ""


def _states(pids: list[int], stopped: bool, timeout_s: float = 2.0) -> tuple[str, ...]:
    """The state letters of ``pids`` once all are stopped (or, with ``stopped`` false,
    none is), or as they are after ``timeout_s``: a signal is delivered asynchronously."""
    deadline = time.monotonic() + timeout_s
    while True:
        states = tuple(_state(pid) for pid in pids)
        if all((state == STOPPED) == stopped for state in states) or time.monotonic() > deadline:
            return states
        time.sleep(0.05)


def _group(group: int) -> list[int]:
    """The processes of process group ``group``."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == group:
            found.append(int(entry.name))
    return sorted(found)


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
        ports = free_ports(6)  # distinct
        self.ports, self.metrics_ports = ports[:3], ports[3:]
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

    def idle_cancels(self) -> tuple[int | None, ...]:
        """Each daemon's count of streams it cancelled for idleness (its metrics; None
        where they did not answer)."""
        return tuple(_idle_cancels(port) for port in self.metrics_ports)

    def manifest(self, number: int) -> str:
        """The manifest digest daemon ``number`` reports for the dataset (``ListDatasets``)."""
        with grpc.insecure_channel(self.addresses[number]) as channel:
            reply = feeder_pb2_grpc.FeederStub(channel).ListDatasets(feeder_pb2.ListDatasetsRequest(), timeout=30)
        return next((info.manifest_sha256 for info in reply.datasets if info.name == DATASET), "")

    # -- the faults ------------------------------------------------------------------------
    def make(self, fault: Fault) -> Evidence:
        """Make ``fault``, wait it out, put it right; what was measured meanwhile
        (:func:`tests.chaos.evidence.not_landed` says whether it took place)."""
        acts: dict[Kind, Callable[[Fault], Evidence]] = {
            Kind.DAEMON_KILLED: self._daemon_killed, Kind.DAEMON_STOPPED: self._daemon_stopped,
            Kind.DAEMON_RESTARTED: self._daemon_restarted, Kind.DAEMON_OTHER_MANIFEST: self._other_manifest,
            Kind.CONSUMER_PAUSED: self._consumer_paused, Kind.STORE_STOPPED: self._store_stopped,
            Kind.STORE_KILLED: self._store_killed, Kind.OBJECT_DAMAGED: self._object_damaged,
            Kind.CREDENTIALS_ROTATED: self._credentials_rotated,
        }
        return acts[fault.kind](fault)

    def _daemon(self, number: int) -> DaemonProcess:
        daemon = self.daemons[number]
        if daemon is None:
            raise RuntimeError(f"daemon {number} is not running")
        return daemon

    def _daemon_killed(self, fault: Fault) -> ProcessEnded:
        daemon, manifest = self._daemon(fault.target), self.manifest(fault.target)
        os.kill(daemon.pid, signal.SIGKILL)
        status = daemon.stop()
        time.sleep(fault.duration_s)
        self.start_daemon(fault.target)
        return ProcessEnded(status, daemon.pid, self._daemon(fault.target).pid, manifest, self.manifest(fault.target))

    def _daemon_stopped(self, fault: Fault) -> ProcessesStopped:
        pid = self._daemon(fault.target).pid
        os.kill(pid, signal.SIGSTOP)
        states = _states([pid], stopped=True)  # the signal is delivered asynchronously
        time.sleep(fault.duration_s)
        os.kill(pid, signal.SIGCONT)
        return ProcessesStopped(states, _states([pid], stopped=False))

    def _restart(self, number: int, root: str) -> ProcessEnded:
        daemon, manifest = self._daemon(number), self.manifest(number)
        status = daemon.stop()
        self.serving[number] = root
        self.start_daemon(number)
        return ProcessEnded(status, daemon.pid, self._daemon(number).pid, manifest, self.manifest(number))

    def _daemon_restarted(self, fault: Fault) -> ProcessEnded:
        return self._restart(fault.target, self.serving[fault.target])

    def _other_manifest(self, fault: Fault) -> ProcessEnded:
        return self._restart(fault.target, self.other)

    def _consumer_paused(self, fault: Fault) -> IdleCancels:
        """The ranks pause for the fault's duration, and on until a daemon has cancelled
        a paused stream for idleness (at most ``_PAUSE_HELD_S``): beside other work a
        fixed pause could end before the daemons had filled the paused calls' windows."""
        before, least = self.idle_cancels(), time.monotonic() + fault.duration_s
        tell(self.control, "pause", str(time.time() + _PAUSE_HELD_S))
        wait_for(lambda: IdleCancels(before, self.idle_cancels()).cancelled() > 0, timeout_s=_PAUSE_HELD_S)
        time.sleep(max(0.0, least - time.monotonic()))
        tell(self.control, "pause", "0")
        return IdleCancels(before, self.idle_cancels())

    def _store_pid(self) -> int:
        process = self.store._process  # noqa: SLF001 - its process group is the store
        if process is None:
            raise RuntimeError("the store is not running")
        return process.pid

    def _store_stopped(self, fault: Fault) -> ProcessesStopped:
        group = self._store_pid()
        os.killpg(group, signal.SIGSTOP)
        members = _group(group)
        states = _states(members, stopped=True)
        time.sleep(fault.duration_s)
        os.killpg(group, signal.SIGCONT)
        return ProcessesStopped(states, _states(members, stopped=False))

    def _store_killed(self, fault: Fault) -> StoreKilled:
        pid = self._store_pid()
        self.store.stop(kill=True)
        gone = _state(pid) in ("", "Z")
        time.sleep(fault.duration_s)
        self.store.start()
        return StoreKilled(pid, gone, self._store_pid())

    def _objects(self) -> ObjectStore:
        """The store as the daemons see it (their keys: the environment's)."""
        return ObjectStore(ObjectUrl.parse(self.url), StoreOptions(endpoint_url=self.store.endpoint_url,
                                                                  retry_window_s=30))

    def _object_damaged(self, fault: Fault) -> ObjectDamage:
        objects = self._objects()
        tars = sorted(name for name in objects.listing("train") if name.endswith(".tar"))
        name = self._rng.choice(tars)
        data = objects.read_bytes(name)
        before = objects.head(name)
        objects.delete([name])
        answer = _answer(lambda: objects.head(name))
        listed = name in objects.listing("train")
        time.sleep(fault.duration_s)
        objects.put_bytes(name, bytes(b ^ 0xA5 for b in data))
        copy = objects.head(name)
        time.sleep(fault.duration_s)
        objects.put_bytes(name, data)
        return ObjectDamage(name, before.size, before.etag, answer, listed, copy.size, copy.etag,
                            objects.head(name).etag)

    def _credentials_rotated(self, fault: Fault) -> KeysRotated:
        keys = self.store.access_key, self.store.secret_key
        self.store.rotate_credentials("rotated", "rotated-secret")
        rotated = self._answer_until(lambda answer: answer != ACCEPTED)  # the store reads its identity again
        time.sleep(fault.duration_s)
        self.store.rotate_credentials(*keys)
        return KeysRotated(rotated, self._answer_until(lambda answer: answer == ACCEPTED))

    def _answer_until(self, wanted: Callable[[str], bool], timeout_s: float = 10.0) -> str:
        """The store's answer to the daemons' keys (a byte of the manifest), asked
        again until ``wanted`` holds of it or ``timeout_s`` has passed."""
        deadline = time.monotonic() + timeout_s
        while True:
            answer = _answer(lambda: self._objects().get_range("manifest.json", 0, 1))
            if wanted(answer) or time.monotonic() > deadline:
                return answer
            time.sleep(0.1)


def _idle_cancels(port: int) -> int | None:
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return None
    return sum(int(float(line.split()[-1])) for line in text.splitlines()
               if line.startswith("feeder_streams_idle_cancelled_total"))


def _answer(call: Callable[[], object]) -> str:
    """``accepted``, or the class name of the store's permanent refusal of ``call``
    (another error is raised: the fault was not made)."""
    try:
        call()
    except (ObjectMissing, StoreRefused) as e:
        return type(e).__name__
    return ACCEPTED


@contextmanager
def daemons_up(cluster: Cluster) -> Iterator[Cluster]:
    """The cluster's three daemons started (at once), stopped on exit."""
    with ExitStack() as stack, ThreadPoolExecutor(3) as starting:
        stack.callback(cluster.stop_all)
        for started in [starting.submit(cluster.start_daemon, n) for n in range(3)]:
            started.result()
        yield cluster
