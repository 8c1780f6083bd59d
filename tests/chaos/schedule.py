"""A fault schedule, a pure function of a seed: which faults, when, for how long and
on what. Faults follow one another (each starts after the one before has been put
right, and a gap), so that every fault is one a running job meets alone, as most are.

Durations are the ones a cluster makes (``full``); ``quick`` shortens the long ones
(a store stopped for 5-90 s becomes 4-8 s) so that a schedule runs in about a minute,
for the test suite's fixed seeds.
"""

from __future__ import annotations

import enum
import random
from dataclasses import dataclass

__all__ = ["Fault", "Kind", "schedule"]


class Kind(str, enum.Enum):
    """The faults a schedule draws from."""

    DAEMON_KILLED = "daemon SIGKILLed (restarted on its port after a while)"
    DAEMON_STOPPED = "daemon SIGSTOPped, then SIGCONTed"
    DAEMON_RESTARTED = "daemon restarted on its port, same data"
    DAEMON_OTHER_MANIFEST = "daemon restarted on its port serving another manifest under the name"
    CONSUMER_PAUSED = "consumer paused past the daemons' idle timeout (streams cancelled)"
    STORE_STOPPED = "object store SIGSTOPped, then SIGCONTed"
    STORE_KILLED = "object store SIGKILLed and restarted"
    OBJECT_DAMAGED = "a shard object deleted, then a same-size corrupt copy, then put back"
    CREDENTIALS_ROTATED = "the store's credentials rotated, then restored"


# Seconds each fault lasts: (full, quick) ranges.
_DURATIONS: dict[Kind, tuple[tuple[float, float], tuple[float, float]]] = {
    Kind.DAEMON_KILLED: ((2.0, 6.0), (1.5, 3.0)),
    Kind.DAEMON_STOPPED: ((3.0, 10.0), (3.0, 5.0)),
    Kind.DAEMON_RESTARTED: ((0.0, 0.0), (0.0, 0.0)),
    Kind.DAEMON_OTHER_MANIFEST: ((0.0, 0.0), (0.0, 0.0)),
    Kind.CONSUMER_PAUSED: ((3.0, 6.0), (3.0, 4.0)),
    Kind.STORE_STOPPED: ((5.0, 90.0), (4.0, 8.0)),
    Kind.STORE_KILLED: ((1.0, 5.0), (1.0, 2.0)),
    Kind.OBJECT_DAMAGED: ((2.0, 4.0), (1.5, 2.5)),  # each of its two phases
    Kind.CREDENTIALS_ROTATED: ((3.0, 10.0), (2.0, 3.0)),
}
_GAP_S = ((1.0, 3.0), (0.5, 1.5))  # between one fault put right and the next: full, quick
_DAEMONS = 3


@dataclass(frozen=True)
class Fault:
    """One fault: its kind, when it starts (seconds after the ranks start), how long
    it lasts, and its target (a daemon's number, or 0)."""

    kind: Kind
    at_s: float
    duration_s: float
    target: int = 0

    def describe(self) -> str:
        who = f" (daemon {self.target})" if self.kind.name.startswith("DAEMON") else ""
        return f"{self.at_s:6.1f} s: {self.kind.value}{who}, {self.duration_s:.1f} s"


def schedule(seed: int, faults: int = 6, quick: bool = False) -> list[Fault]:
    """``faults`` faults drawn from every kind, one at a time, from ``seed``. At most
    one daemon is restarted on another manifest (the pool leaves it for good), and
    the faults after it spare it."""
    rng = random.Random(seed)
    kinds = list(Kind)
    drawn = rng.sample(kinds, min(faults, len(kinds)))
    drawn += [rng.choice([k for k in kinds if k is not Kind.DAEMON_OTHER_MANIFEST])
              for _ in range(faults - len(drawn))]
    gap = _GAP_S[1 if quick else 0]
    at, found, gone = rng.uniform(*gap), [], None
    for kind in drawn:
        low, high = _DURATIONS[kind][1 if quick else 0]
        duration = round(rng.uniform(low, high), 1)
        daemons = [d for d in range(_DAEMONS) if d != gone]
        target = rng.choice(daemons) if kind.name.startswith("DAEMON") else 0
        if kind is Kind.DAEMON_OTHER_MANIFEST:
            gone = target
        found.append(Fault(kind, round(at, 1), duration, target))
        at += duration * (2 if kind is Kind.OBJECT_DAMAGED else 1) + rng.uniform(*gap)
    return found
