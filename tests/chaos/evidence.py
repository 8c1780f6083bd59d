"""What was measured while a fault of a schedule was made, and one predicate per
fault kind that says whether the fault took place: a kill's exit status, the process
state while stopped, a counter that went up, an ETag that changed, keys the store
refused. Every field is read from the process, the daemons or the store, never
copied from the schedule; :func:`not_landed` names each part of a fault that did not
happen, and a run fails on any (a fault test proves its fault happened: a schedule
whose faults never landed would pass every check of what the ranks received).
"""

from __future__ import annotations

import signal
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

from tests.chaos.schedule import Kind

__all__ = ["Evidence", "IdleCancels", "KeysRotated", "ObjectDamage", "ProcessEnded", "ProcessesStopped",
           "StoreKilled", "not_landed", "recorded"]

STOPPED = "T"  # /proc/PID/stat's state letter of a process stopped by a signal
REFUSED = "StoreRefused"  # the store client's error for credentials the store refuses (401, 403)
MISSING = "ObjectMissing"  # its error for an object that is not there (404)
ACCEPTED = "accepted"  # an answer that was no error


@dataclass(frozen=True)
class ProcessEnded:
    """A daemon ended and started again on its port (killed, or restarted on its own
    data or on another manifest): its exit status, its pid before and after, and the
    manifest digest it reported (``ListDatasets``) before and after."""

    exit_status: int
    pid_before: int
    pid_after: int
    manifest_before: str
    manifest_after: str


@dataclass(frozen=True)
class ProcessesStopped:
    """The state letter of each process of the target (the daemon, or every process of
    the store's group) once it was sent SIGSTOP, and again after SIGCONT."""

    states_while: tuple[str, ...]
    states_after: tuple[str, ...]


@dataclass(frozen=True)
class StoreKilled:
    """The store's process group SIGKILLed: whether its pid was gone (or a zombie)
    afterwards, and the pid of the store started again."""

    pid_before: int
    gone: bool
    pid_after: int


@dataclass(frozen=True)
class IdleCancels:
    """Each daemon's ``feeder_streams_idle_cancelled_total`` before the consumers paused
    and after (None: its metrics did not answer)."""

    before: tuple[int | None, ...]
    after: tuple[int | None, ...]

    def cancelled(self) -> int:
        """Streams cancelled meanwhile, over the daemons read both times."""
        return sum(a - b for b, a in zip(self.before, self.after) if a is not None and b is not None)


@dataclass(frozen=True)
class ObjectDamage:
    """A shard object deleted, replaced by a corrupt copy, then put back: its size and
    ETag, the store's answer to a HEAD of it and whether a listing had it while it was
    deleted, the copy's size and ETag, and the ETag once put back."""

    name: str
    size: int
    etag: str | None
    answer_while_deleted: str
    listed_while_deleted: bool
    copy_size: int
    copy_etag: str | None
    etag_put_back: str | None


@dataclass(frozen=True)
class KeysRotated:
    """The store's answer to the daemons' keys (a read of the manifest) while its
    credentials were rotated, and once they were restored: an error's class name, or
    ``accepted``."""

    answer_while_rotated: str
    answer_after: str


Evidence = ProcessEnded | ProcessesStopped | StoreKilled | IdleCancels | ObjectDamage | KeysRotated


def _ended(evidence: ProcessEnded, status: int) -> list[str]:
    missed = []
    if evidence.exit_status != status:
        missed.append(f"exit status {evidence.exit_status}, {status} expected")
    if evidence.pid_after in (0, evidence.pid_before):
        missed.append(f"no new process (pid {evidence.pid_before} before, {evidence.pid_after} after)")
    return missed


def _killed(evidence: ProcessEnded) -> list[str]:
    return _ended(evidence, -signal.SIGKILL)


def _restarted(evidence: ProcessEnded) -> list[str]:
    missed = _ended(evidence, 0)
    if evidence.manifest_after != evidence.manifest_before:
        missed.append(f"serves manifest {evidence.manifest_after[:12]} after, {evidence.manifest_before[:12]} "
                      "before (the same data expected)")
    return missed


def _other_manifest(evidence: ProcessEnded) -> list[str]:
    missed = _ended(evidence, 0)
    if not evidence.manifest_after or evidence.manifest_after == evidence.manifest_before:
        missed.append(f"serves manifest {evidence.manifest_after[:12] or 'none'} after, as before (another "
                      "expected)")
    return missed


def _stopped(evidence: ProcessesStopped) -> list[str]:
    missed = []
    if not evidence.states_while or any(s != STOPPED for s in evidence.states_while):
        missed.append(f"states {list(evidence.states_while)} while stopped, all {STOPPED} expected")
    if not evidence.states_after or any(s == STOPPED for s in evidence.states_after):
        missed.append(f"states {list(evidence.states_after)} after SIGCONT, none {STOPPED} expected")
    return missed


def _store_killed(evidence: StoreKilled) -> list[str]:
    missed = [] if evidence.gone else [f"pid {evidence.pid_before} still there after SIGKILL"]
    if evidence.pid_after in (0, evidence.pid_before):
        missed.append(f"no new store process (pid {evidence.pid_before} before, {evidence.pid_after} after)")
    return missed


def _paused(evidence: IdleCancels) -> list[str]:
    if evidence.cancelled() > 0:
        return []
    return [f"no stream cancelled for idleness (counters {list(evidence.before)} before, "
            f"{list(evidence.after)} after)"]


def _damaged(evidence: ObjectDamage) -> list[str]:
    missed = []
    if evidence.answer_while_deleted != MISSING or evidence.listed_while_deleted:
        missed.append(f"{evidence.name} not gone while deleted ({evidence.answer_while_deleted}, "
                      f"{'listed' if evidence.listed_while_deleted else 'not listed'})")
    if evidence.copy_size != evidence.size or evidence.etag is None or evidence.copy_etag == evidence.etag:
        missed.append(f"{evidence.name}'s copy is {evidence.copy_size} bytes with ETag {evidence.copy_etag}, "
                      f"{evidence.size} bytes and another ETag than {evidence.etag} expected")
    if evidence.etag is None or evidence.etag_put_back != evidence.etag:
        missed.append(f"{evidence.name} put back with ETag {evidence.etag_put_back}, {evidence.etag} expected")
    return missed


def _rotated(evidence: KeysRotated) -> list[str]:
    missed = []
    if evidence.answer_while_rotated != REFUSED:
        missed.append(f"the daemons' keys got {evidence.answer_while_rotated} while rotated, {REFUSED} expected")
    if evidence.answer_after != ACCEPTED:
        missed.append(f"the daemons' keys got {evidence.answer_after} once restored, {ACCEPTED} expected")
    return missed


_PREDICATES: dict[Kind, tuple[type, Callable[[Any], list[str]]]] = {
    Kind.DAEMON_KILLED: (ProcessEnded, _killed),
    Kind.DAEMON_STOPPED: (ProcessesStopped, _stopped),
    Kind.DAEMON_RESTARTED: (ProcessEnded, _restarted),
    Kind.DAEMON_OTHER_MANIFEST: (ProcessEnded, _other_manifest),
    Kind.CONSUMER_PAUSED: (IdleCancels, _paused),
    Kind.STORE_STOPPED: (ProcessesStopped, _stopped),
    Kind.STORE_KILLED: (StoreKilled, _store_killed),
    Kind.OBJECT_DAMAGED: (ObjectDamage, _damaged),
    Kind.CREDENTIALS_ROTATED: (KeysRotated, _rotated),
}


def not_landed(kind: Kind, evidence: Evidence | None) -> list[str]:
    """What of a fault of ``kind`` did not happen, by its ``evidence`` (None: the fault
    could not be made); empty when it took place."""
    expected, predicate = _PREDICATES[kind]
    if not isinstance(evidence, expected):
        return [f"{type(evidence).__name__} recorded, {expected.__name__} expected"]
    return predicate(evidence)


def recorded(evidence: Evidence | None) -> dict[str, Any] | None:
    """``evidence`` as the run's JSON keeps it (its type's name and its fields)."""
    return None if evidence is None else {"type": type(evidence).__name__, **asdict(evidence)}
