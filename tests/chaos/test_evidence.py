"""The predicate of each fault kind (no cluster: what a fault measured, made up here):
it passes what a fault that happened measures and names what did not happen, and a
schedule with a fault that did not land, or that met no rank reading, fails naming it."""

from __future__ import annotations

import pytest

from tests.chaos.evidence import (
    Evidence,
    IdleCancels,
    KeysRotated,
    ObjectDamage,
    ProcessEnded,
    ProcessesStopped,
    StoreKilled,
    not_landed,
    recorded,
)
from tests.chaos.run import _make_faults, fault_problems
from tests.chaos.schedule import Fault, Kind

A, B = "a" * 64, "b" * 64  # two manifest digests
DAMAGE = ObjectDamage("train/shard-000001.tar", 1000, "e1", "ObjectMissing", False, 1000, "e2", "e1")

# kind -> (what a fault that took place measured, [what ones that did not measured, and the words naming why])
CASES: dict[Kind, tuple[Evidence, list[tuple[Evidence, str]]]] = {
    Kind.DAEMON_KILLED: (ProcessEnded(-9, 10, 11, A, A), [
        (ProcessEnded(0, 10, 11, A, A), "exit status 0, -9 expected"),  # it ended by SIGTERM, say
        (ProcessEnded(-9, 10, 10, A, A), "no new process"),
    ]),
    Kind.DAEMON_STOPPED: (ProcessesStopped(("T",), ("S",)), [
        (ProcessesStopped(("S",), ("S",)), "while stopped"),  # the signal never arrived
        (ProcessesStopped((), ()), "while stopped"),  # no process to stop
        (ProcessesStopped(("T",), ("T",)), "after SIGCONT"),
    ]),
    Kind.DAEMON_RESTARTED: (ProcessEnded(0, 10, 11, A, A), [
        (ProcessEnded(-9, 10, 11, A, A), "exit status -9, 0 expected"),
        (ProcessEnded(0, 10, 0, A, ""), "no new process"),
        (ProcessEnded(0, 10, 11, A, B), "the same data expected"),
    ]),
    Kind.DAEMON_OTHER_MANIFEST: (ProcessEnded(0, 10, 11, A, B), [
        (ProcessEnded(0, 10, 11, A, A), "another expected"),  # restarted on the same data
        (ProcessEnded(0, 10, 11, A, ""), "another expected"),
    ]),
    Kind.CONSUMER_PAUSED: (IdleCancels((0, 1, None), (2, 1, 4)), [
        (IdleCancels((0, 0, 0), (0, 0, 0)), "no stream cancelled"),  # "0 streams cancelled"
        (IdleCancels((None, 0, 0), (3, 0, 0)), "no stream cancelled"),  # a daemon whose metrics came back
    ]),
    Kind.STORE_STOPPED: (ProcessesStopped(("T", "T"), ("S", "R")), [
        (ProcessesStopped(("T", "S"), ("S", "S")), "while stopped"),  # one process of its group ran on
    ]),
    Kind.STORE_KILLED: (StoreKilled(20, True, 21), [
        (StoreKilled(20, False, 21), "still there"),
        (StoreKilled(20, True, 20), "no new store process"),
    ]),
    Kind.OBJECT_DAMAGED: (DAMAGE, [
        (ObjectDamage(DAMAGE.name, 1000, "e1", "accepted", False, 1000, "e2", "e1"), "not gone while deleted"),
        (ObjectDamage(DAMAGE.name, 1000, "e1", "ObjectMissing", True, 1000, "e2", "e1"), "not gone while deleted"),
        (ObjectDamage(DAMAGE.name, 1000, "e1", "ObjectMissing", False, 1000, "e1", "e1"), "another ETag"),
        (ObjectDamage(DAMAGE.name, 1000, None, "ObjectMissing", False, 1000, None, None), "another ETag"),
        (ObjectDamage(DAMAGE.name, 1000, "e1", "ObjectMissing", False, 999, "e2", "e1"), "1000 bytes"),
        (ObjectDamage(DAMAGE.name, 1000, "e1", "ObjectMissing", False, 1000, "e2", "e2"), "put back"),
    ]),
    Kind.CREDENTIALS_ROTATED: (KeysRotated("StoreRefused", "accepted"), [
        (KeysRotated("accepted", "accepted"), "while rotated"),  # "not refused"
        (KeysRotated("ObjectMissing", "accepted"), "while rotated"),  # refused, but not for the keys
        (KeysRotated("StoreRefused", "StoreRefused"), "once restored"),
    ]),
}


def test_every_kind_has_a_case() -> None:
    assert set(CASES) == set(Kind)


@pytest.mark.parametrize("kind", list(Kind), ids=lambda k: k.name.lower())
def test_each_predicate_passes_a_fault_that_happened_and_names_one_that_did_not(kind: Kind) -> None:
    happened, missed = CASES[kind]
    assert not_landed(kind, happened) == []
    for evidence, words in missed:
        found = not_landed(kind, evidence)
        assert any(words in line for line in found), (evidence, found)


def test_evidence_of_another_kind_or_none_is_no_proof() -> None:
    assert not_landed(Kind.DAEMON_STOPPED, StoreKilled(20, True, 21)) == [
        "StoreKilled recorded, ProcessesStopped expected"]
    assert not_landed(Kind.STORE_KILLED, None) == ["NoneType recorded, StoreKilled expected"]
    assert recorded(StoreKilled(20, True, 21)) == {"type": "StoreKilled", "pid_before": 20, "gone": True,
                                                   "pid_after": 21}


class _Cluster:
    """Makes each fault by returning what it is given (or raising it)."""

    def __init__(self, *results: Evidence | Exception) -> None:
        self.results = list(results)

    def make(self, fault: Fault) -> Evidence:
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


FAULTS = [Fault(Kind.DAEMON_KILLED, 0.0, 0.0, target=2), Fault(Kind.CONSUMER_PAUSED, 0.0, 0.0),
          Fault(Kind.STORE_STOPPED, 0.0, 0.0)]


def _reading(faults: list[dict]) -> dict[int, list[dict]]:
    """One rank with a batch before the first fault and after the last."""
    return {0: [{"t": faults[0]["begun"] - 1}, {"t": faults[-1]["ended"] + 1}]}


def test_a_schedule_whose_faults_landed_has_no_problem() -> None:
    made = _make_faults(_Cluster(*(CASES[f.kind][0] for f in FAULTS)), FAULTS)
    assert fault_problems(made, _reading(made)) == []
    assert made[0]["evidence"]["exit_status"] == -9 and made[0]["not_landed"] == []


def test_a_fault_that_did_not_land_or_could_not_be_made_fails_the_schedule_naming_it() -> None:
    cluster = _Cluster(ProcessEnded(0, 10, 11, A, A), IdleCancels((3, 0, 0), (3, 0, 0)), RuntimeError("no store"))
    made = _make_faults(cluster, FAULTS)
    assert fault_problems(made, _reading(made)) == [
        "fault 0 (daemon 2 killed): exit status 0, -9 expected",
        "fault 1 (consumer paused): no stream cancelled for idleness (counters [3, 0, 0] before, [3, 0, 0] after)",
        "fault 2 (store stopped): not made: RuntimeError: no store",
    ]
    assert made[2]["evidence"] is None


def test_a_fault_made_when_no_rank_was_reading_fails_the_schedule() -> None:
    made = _make_faults(_Cluster(*(CASES[f.kind][0] for f in FAULTS)), FAULTS)
    done_before = {0: [{"t": made[0]["begun"] - 1}], 1: [{"t": made[0]["begun"] - 1}, {"t": made[-1]["ended"] + 1}]}
    assert fault_problems(made, done_before) == [
        f"fault {n} ({name}): rank 0 had no batch before it began and after it ended"
        for n, name in enumerate(["daemon 2 killed", "consumer paused", "store stopped"])]
