"""The daemon's --fair-share policy: which lanes of the decode pool share one share.
The shares' worker time is checked in tests/core/test_workers.py (by the pool) and
tests/feeder/test_job_shares.py (a real daemon)."""

from __future__ import annotations

import pytest

from core.errors import ConfigError
from core.workers import FairPool
from feeder.shares import FairShares, Member


@pytest.fixture()
def pool():
    pool = FairPool(1, name="t-shares")
    yield pool
    pool.close()


def _open(shares: FairShares, pool: FairPool, stream: str, job: str, client: str) -> Member:
    member = Member(pool.lane(stream), job, client)
    shares.join(stream, member)
    return member


def _groups(shares: FairShares) -> set[frozenset[str]]:
    return {frozenset(str(s) for s in tenant) for tenant in shares.tenants()}


def test_per_stream_leaves_every_lane_a_share_of_its_own(pool):
    shares = FairShares(pool, "per-stream")
    members = [_open(shares, pool, f"s{k}", "job", "pid=1") for k in range(3)]
    assert len({id(m.lane.share) for m in members}) == 3
    assert _groups(shares) == {frozenset({"s0"}), frozenset({"s1"}), frozenset({"s2"})}


def test_per_job_puts_a_jobs_ranks_in_one_share_and_each_job_in_its_own(pool):
    shares = FairShares(pool, "per-job")
    ranks = [_open(shares, pool, f"a{k}", "job-a", f"pid={100 + k}") for k in range(8)]
    alone = _open(shares, pool, "b0", "job-b", "pid=200")
    assert len({id(m.lane.share) for m in ranks}) == 1
    assert alone.lane.share is not ranks[0].lane.share
    assert _groups(shares) == {frozenset(f"a{k}" for k in range(8)), frozenset({"b0"})}


def test_per_job_gives_one_process_one_share_whatever_jobs_it_names(pool):
    shares = FairShares(pool, "per-job")
    named = [_open(shares, pool, f"p{k}", f"job-{k}", "pid=300") for k in range(16)]
    other = _open(shares, pool, "q", "job-q", "pid=400")
    assert len({id(m.lane.share) for m in named}) == 1
    assert other.lane.share is not named[0].lane.share


def test_a_process_in_two_jobs_links_them_until_its_stream_closes(pool):
    shares = FairShares(pool, "per-job")
    a = _open(shares, pool, "a", "job-a", "pid=1")
    b = _open(shares, pool, "b", "job-b", "pid=2")
    assert a.lane.share is not b.lane.share
    link = _open(shares, pool, "link", "job-b", "pid=1")  # process 1 names job-b too
    assert a.lane.share is b.lane.share is link.lane.share
    shares.leave("link")
    assert a.lane.share is not b.lane.share
    assert link.lane.share is not a.lane.share and link.lane.share is not b.lane.share  # back in its own


def test_a_job_keeps_its_share_as_its_ranks_open_and_close(pool):
    shares = FairShares(pool, "per-job")
    first = _open(shares, pool, "r0", "job", "pid=1")
    second = _open(shares, pool, "r1", "job", "pid=2")
    share = first.lane.share
    third = _open(shares, pool, "r2", "job", "pid=3")
    shares.leave("r0")
    assert second.lane.share is third.lane.share is share
    shares.leave("r1")
    shares.leave("r2")
    shares.leave("r2")  # twice: nothing
    assert shares.tenants() == []


def test_an_unknown_policy_is_refused(pool):
    with pytest.raises(ConfigError, match="fair_share: 'per-rank' is not one of per-job, per-stream"):
        FairShares(pool, "per-rank")
