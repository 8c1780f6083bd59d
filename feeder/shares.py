"""Which share of the decode pool each open stream's lane is in, as ``--fair-share``
says (:class:`FairShares`).

- ``per-stream``: every lane in a share of its own, of weight 1: each stream with work
  gets an equal part of the threads' time, so a job of 8 ranks gets 8 times a job of 1.
- ``per-job``: one share per *tenant*, split equally among the tenant's streams with
  work. A tenant is a job, with every other job that one of its clients (processes:
  :class:`feeder.admission.Client`) names: the jobs and the clients linked by open
  streams, a connected part of that graph. So a job of 8 ranks (8 processes) gets
  what a job of 1 gets, and one process naming 16 jobs gets one share, not 16; a
  request without a job is its client's own job, so a process opening 16
  connections is one tenant too. Shares are recomputed whenever a stream opens or
  closes (a few dozen streams at most: ``max_streams``).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable
from dataclasses import dataclass

from core.errors import ConfigError
from core.workers import FairPool, Lane, Share
from feeder.config import FAIR_SHARES

__all__ = ["FairShares", "Member"]


@dataclass(frozen=True)
class Member:
    """An open stream's part in the shares: its lane, its job and its client."""

    lane: Lane
    job: str
    client: str


class _Links:
    """Union-find over jobs and clients (tagged, so a job and a client may have the
    same text)."""

    def __init__(self) -> None:
        self._parent: dict[tuple[str, str], tuple[str, str]] = {}

    def root(self, node: tuple[str, str]) -> tuple[str, str]:
        parent = self._parent.setdefault(node, node)
        while parent != node:
            self._parent[node] = self._parent.setdefault(parent, parent)
            node, parent = parent, self._parent[parent]
        return node

    def link(self, a: tuple[str, str], b: tuple[str, str]) -> None:
        self._parent[self.root(a)] = self.root(b)


class FairShares:
    """The shares of the daemon's decode pool. Thread-safe.

    Args:
        pool: the decode pool the lanes are on.
        policy: ``per-stream`` or ``per-job`` (see the module doc).

    Raises:
        ConfigError: another policy.
    """

    def __init__(self, pool: FairPool, policy: str) -> None:
        if policy not in FAIR_SHARES:
            raise ConfigError(f"fair_share: {policy!r} is not one of {', '.join(FAIR_SHARES)}")
        self._pool = pool
        self.policy = policy
        self._members: dict[Hashable, Member] = {}
        self._made: dict[int, Share] = {}  # the tenants' shares, by id
        self._lock = threading.Lock()

    def join(self, stream: Hashable, member: Member) -> None:
        """``stream`` is open: its lane goes into its share."""
        with self._lock:
            self._members[stream] = member
            self._regroup()

    def leave(self, stream: Hashable) -> None:
        """``stream`` closed: its lane goes back into a share of its own (the lane
        is pooled with its pipeline), and the others are regrouped."""
        with self._lock:
            member = self._members.pop(stream, None)
            if member is None:
                return
            member.lane.join(None)
            self._regroup()

    def tenants(self) -> list[list[Hashable]]:
        """The open streams by share (per-stream: one each), for the log and tests."""
        with self._lock:
            return [list(streams) for streams in self._tenants().values()]

    def _tenants(self) -> dict[tuple[str, str], list[Hashable]]:
        """Streams by tenant (lock held)."""
        if self.policy == "per-stream":
            return {("stream", str(id(stream))): [stream] for stream in self._members}
        links = _Links()
        for member in self._members.values():
            links.link(("job", member.job), ("client", member.client))
        tenants: dict[tuple[str, str], list[Hashable]] = {}
        for stream, member in self._members.items():
            tenants.setdefault(links.root(("job", member.job)), []).append(stream)
        return tenants

    def _regroup(self) -> None:
        """Put every open stream's lane in its tenant's share (lock held). A tenant
        keeps the share most of its lanes are in already, so a stream opening or
        closing moves only the lanes whose tenant changed."""
        if self.policy == "per-stream":
            return  # every lane stays in a share of its own
        kept: dict[int, Share] = {}
        for streams in sorted(self._tenants().values(), key=len, reverse=True):
            members = [self._members[s] for s in streams]
            share = self._share_for(members, kept)
            for member in members:
                member.lane.join(share)
        self._made = kept  # the shares of tenants gone are dropped

    def _share_for(self, members: list[Member], kept: dict[int, Share]) -> Share:
        """The share most of ``members``' lanes are in, of those this made and no
        tenant has taken yet; else a new one (lock held)."""
        votes = Counter(id(m.lane.share) for m in members if id(m.lane.share) in self._made)
        for taken in kept:
            votes.pop(taken, None)
        if votes:
            share = self._made[votes.most_common(1)[0][0]]
        else:
            share = self._pool.share(f"job {members[0].job}")
        kept[id(share)] = share
        return share
