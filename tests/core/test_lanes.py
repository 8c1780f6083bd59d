"""A pool's lanes grouped in shares (:class:`core.lanes.Share`): a share's busy lanes
together get what one lane beside them gets, in proportion to the shares' weights,
as lanes join and leave; and what a lane counts of its items (CPU seconds).

Checked on a clock that counts work, not seconds (``tests.common.work_clock``), with
every lane given its work while the workers are held, so that they start together."""

from __future__ import annotations

import threading
import time

import pytest

from core.errors import ConfigError
from core.lanes import Lane
from core.workers import FairPool
from tests.common.work_clock import WorkClock, WorkLog, held


def _busy(pool: FairPool, log: WorkLog, clock: WorkClock, name: str, cost: float = 1.0, share=None) -> Lane:
    lane = pool.lane(name)
    if share is not None:
        lane.join(share)
    lane.parallel(log.work(clock, name, cost), 1_000_000)  # always work queued
    return lane


def _share_of(shares: dict[str, float], prefix: str) -> float:
    return sum(units for name, units in shares.items() if name.startswith(prefix))


def test_a_share_of_eight_busy_lanes_gets_the_time_of_one_lane_beside_it():
    clock = WorkClock()
    pool = FairPool(2, name="t-share", clock=clock)
    log = WorkLog(units=6000)
    job = pool.share("job-8")
    with held(pool):
        ranks = [_busy(pool, log, clock, f"rank-{k}", cost=1.0 + k % 3, share=job) for k in range(8)]
        alone = _busy(pool, log, clock, "alone", cost=2.0)
    log.wait([*ranks, alone])
    pool.close()
    shares = log.shares()
    assert _share_of(shares, "rank-") / shares["alone"] == pytest.approx(1.0, rel=0.15), shares
    # Within the share, its lanes are equal whatever their items cost.
    assert max(shares[f"rank-{k}"] for k in range(8)) / min(shares[f"rank-{k}"] for k in range(8)) < 1.3, shares


def test_a_shares_lanes_without_work_leave_its_time_to_its_busy_ones():
    clock = WorkClock()
    pool = FairPool(2, name="t-share-idle", clock=clock)
    log = WorkLog(units=3000)
    job = pool.share("job")
    for k in range(3):  # open, and with nothing to do (unread streams)
        pool.lane(f"idle-{k}").join(job)
    with held(pool):
        busy = _busy(pool, log, clock, "busy", share=job)
        alone = _busy(pool, log, clock, "alone")
    log.wait([busy, alone])
    pool.close()
    shares = log.shares()
    assert shares["busy"] / shares["alone"] == pytest.approx(1.0, rel=0.15), shares


def test_busy_shares_get_worker_time_in_proportion_to_their_weights():
    clock = WorkClock()
    pool = FairPool(2, name="t-share-weight", clock=clock)
    log = WorkLog(units=6000)
    heavy, light = pool.share("heavy", weight=2.0), pool.share("light")
    with held(pool):
        lanes = [_busy(pool, log, clock, f"heavy-{k}", share=heavy) for k in range(2)]
        lanes += [_busy(pool, log, clock, f"light-{k}", cost=3.0, share=light) for k in range(3)]
    log.wait(lanes)
    pool.close()
    shares = log.shares()
    assert _share_of(shares, "heavy-") / _share_of(shares, "light-") == pytest.approx(2.0, rel=0.15), shares


def test_a_busy_lane_that_joins_a_share_and_leaves_it_changes_the_shares_from_then_on():
    clock = WorkClock()
    pool = FairPool(2, name="t-join", clock=clock)
    log = WorkLog(units=6000)
    job = pool.share("job")
    second = pool.lane("second")
    logged, lock = log.work(clock, "second", 1.0), threading.Lock()
    joined: list[int] = []  # where the log stood once the join had returned
    left: list[int] = []

    def moving(i: int) -> None:  # from a worker, while every lane is busy
        logged(i)
        with lock:
            if i == 300:
                second.join(job)
                joined.append(len(log.items))
            # Only once the join is done and its window logged: a worker held up
            # between its item and the join must not let the leave come first.
            elif joined and not left and len(log.items) >= joined[0] + 1400:
                second.join(None)
                left.append(len(log.items))

    with held(pool):
        first = _busy(pool, log, clock, "first", share=job)
        second.parallel(moving, 1_000_000)
        third = _busy(pool, log, clock, "third")
    log.wait([first, second, third])
    pool.close()
    # Each window starts a few items after its move: items claimed before it may be logged after it.
    apart, together = log.shares(units=800), log.shares(start=joined[0] + 8, units=1200)
    again = log.shares(start=left[0] + 8, units=1200)
    assert apart["second"] / apart["third"] == pytest.approx(1.0, rel=0.15), apart
    assert together["third"] / (together["first"] + together["second"]) == pytest.approx(1.0, rel=0.15), together
    assert again["second"] / again["third"] == pytest.approx(1.0, rel=0.15), again
    assert second.share is not job


def test_a_lane_joins_only_a_share_of_its_own_pool():
    pool, other = FairPool(1, name="t-own"), FairPool(1, name="t-other")
    lane = pool.lane("x")
    with pytest.raises(ConfigError, match="another pool"):
        lane.join(other.share("y"))
    with pytest.raises(ConfigError, match="weight"):
        pool.share("z", weight=0.0)
    pool.close()
    other.close()


def test_a_lane_counts_the_cpu_seconds_of_its_items():
    pool = FairPool(1, name="t-cpu")
    lane = pool.lane("x")

    def spin(i: int) -> None:
        end = time.thread_time() + 0.05
        while time.thread_time() < end:
            pass

    lane.run(spin, 4)
    pool.close()
    assert 0.2 <= lane.cpu_s <= lane.busy_s + 0.01, (lane.cpu_s, lane.busy_s)
