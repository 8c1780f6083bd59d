"""The shared worker pool: a fixed number of threads, fair shares of their time
between lanes.

The shares are checked on a clock that counts work, not seconds (``WorkClock``): an
item's measured time is the cost it says it has, however loaded the machine, and the
lanes get their work while the workers are held (``held``), so that they start
together: the checks are exact and fast."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from core.errors import ConfigError
from core.workers import FairPool, PoolClosed
from tests.common.work_clock import WorkClock, WorkLog, held


def _threads(name: str) -> int:
    return sum(t.name.startswith(name) for t in threading.enumerate())


def test_every_item_runs_once():
    pool = FairPool(3, name="t-once")
    seen: list[int] = []
    lock = threading.Lock()

    def work(i: int) -> None:
        with lock:
            seen.append(i)

    pool.lane().run(work, 100)
    pool.close()
    assert sorted(seen) == list(range(100))


def test_lanes_that_keep_work_queued_get_equal_shares_however_much_they_ask():
    clock = WorkClock()
    pool = FairPool(2, name="t-fair", clock=clock)
    log = WorkLog(units=4000)
    small, big = pool.lane("small"), pool.lane("big")

    def client(lane, count):
        """Two loops in flight, as a stream's prefetch keeps them: each queues the next
        as it starts, so the lane never runs dry (with two workers, however they are
        scheduled, an item is left while both hold a loop's first)."""
        logged = log.work(clock, lane.name, 1.0)

        def work(i: int) -> None:
            if i == 0:
                lane.parallel(work, count)
            logged(i)
        for _ in range(2):
            lane.parallel(work, count)

    with held(pool):
        client(small, 2)
        client(big, 64)
    log.reached()
    busy_s = {"small": small.busy_s, "big": big.busy_s}  # while both still run
    log.wait([small, big])
    pool.close()
    shares = log.shares()
    assert shares["small"] / shares["big"] == pytest.approx(1.0, rel=0.15), shares
    assert busy_s["small"] / busy_s["big"] == pytest.approx(1.0, rel=0.15), busy_s


def test_what_a_client_waits_on_goes_before_the_work_it_queued_for_later():
    pool = FairPool(1, name="t-first")
    lane = pool.lane()
    busy, gate, order = threading.Event(), threading.Event(), []

    def hold(i: int) -> None:
        busy.set()
        gate.wait()

    lane.parallel(hold, 1)
    assert busy.wait(10)  # the one worker is busy
    later = lane.parallel(lambda i: order.append("later"), 3)
    waited = threading.Thread(target=lane.run, args=(lambda i: order.append("now"), 2))
    waited.start()
    while len(lane.loops) < 2:  # both queued behind the busy worker
        time.sleep(0.001)
    gate.set()
    waited.join()
    later.wait()
    pool.close()
    assert order == ["now", "now", "later", "later", "later"]


def test_no_more_threads_work_than_the_pool_has():
    pool = FairPool(2, name="t-bound")
    running, most = 0, 0
    lock = threading.Lock()

    def work(i: int) -> None:
        nonlocal running, most
        with lock:
            running += 1
            most = max(most, running)
        time.sleep(0.001)
        with lock:
            running -= 1

    loops = [pool.lane(str(k)).parallel(work, 20) for k in range(8)]
    for loop in loops:
        loop.wait()
    pool.close()
    assert most <= 2


def test_an_error_is_raised_after_every_item_ran():
    pool = FairPool(2, name="t-error")
    done: list[int] = []

    def work(i: int) -> None:
        if i == 3:
            raise ValueError("item 3")
        time.sleep(0.001)
        done.append(i)

    with pytest.raises(ValueError, match="item 3"):
        pool.lane().run(work, 10)
    assert len(done) == 9
    pool.close()


def test_a_closed_lane_ends_its_waiting_loops():
    pool = FairPool(1, name="t-close")
    busy, blocker = pool.lane(), threading.Event()
    held = busy.parallel(lambda i: blocker.wait(5), 1)
    lane = pool.lane()
    waiting = lane.parallel(lambda i: None, 5)
    lane.close()
    with pytest.raises(PoolClosed):
        waiting.wait()
    with pytest.raises(PoolClosed):
        lane.run(lambda i: None, 1)
    blocker.set()
    held.wait()
    pool.close()


def test_closing_the_pool_ends_the_loops_its_open_lanes_have_waiting():
    pool = FairPool(1, name="t-close-pool")
    busy, started, blocker = pool.lane(), threading.Event(), threading.Event()
    held = busy.parallel(lambda i: (started.set(), blocker.wait(5)), 1)
    assert started.wait(5)
    shared = pool.share()
    lanes = [pool.lane() for _ in range(3)]
    lanes[1].join(shared)
    lanes[2].join(shared)
    waiting = [lane.parallel(lambda i: None, 4) for lane in lanes]
    pool.close()
    for loop in waiting:
        with pytest.raises(PoolClosed):
            loop.wait()
    blocker.set()
    held.wait()
    with pytest.raises(PoolClosed):
        lanes[0].run(lambda i: None, 1)


def test_the_threads_stop_when_the_pool_is_closed_or_collected():
    closed = FairPool(3, name="t-stop-closed")
    closed.lane().run(lambda i: None, 3)
    closed.close()
    collected = FairPool(3, name="t-stop-collected")
    collected.lane().run(lambda i: None, 3)
    del collected
    gc.collect()
    deadline = time.monotonic() + 5
    while (_threads("t-stop-closed") or _threads("t-stop-collected")) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads("t-stop-closed") == _threads("t-stop-collected") == 0


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_busy_lanes_get_equal_worker_time_whatever_their_items_cost(threads):
    clock = WorkClock()
    pool = FairPool(threads, name="t-cost", clock=clock)
    log = WorkLog(units=4000)
    small, big = pool.lane("small"), pool.lane("big")
    with held(pool):
        small.parallel(log.work(clock, "small", 1.0), 1_000_000)  # always work queued
        big.parallel(log.work(clock, "big", 4.0), 1_000_000)
    log.reached()
    # Read while both lanes still run: once one is closed, the other has the workers alone.
    busy_s = {"small": small.busy_s, "big": big.busy_s}
    log.wait([small, big])
    pool.close()
    shares = log.shares()
    assert shares["small"] / shares["big"] == pytest.approx(1.0, rel=0.15), shares
    assert busy_s["small"] / busy_s["big"] == pytest.approx(1.0, rel=0.15)  # counted on the pool's clock


def test_busy_lanes_get_worker_time_in_proportion_to_their_weights():
    clock = WorkClock()
    pool = FairPool(2, name="t-weight", clock=clock)
    log = WorkLog(units=6000)
    heavy, light = pool.lane("heavy", weight=2.0), pool.lane("light")
    with held(pool):
        heavy.parallel(log.work(clock, "heavy", 4.0), 1_000_000)  # the costly items, and twice the share
        light.parallel(log.work(clock, "light", 1.0), 1_000_000)
    log.wait([heavy, light])
    pool.close()
    shares = log.shares()
    assert shares["heavy"] / shares["light"] == pytest.approx(2.0, rel=0.15), shares


def test_a_new_weight_changes_the_shares_from_then_on():
    clock = WorkClock()
    pool = FairPool(2, name="t-reweight", clock=clock)
    log = WorkLog(units=3000)
    first, second = pool.lane("first"), pool.lane("second")
    logged, marks = log.work(clock, "second", 1.0), []

    def reweigh(i: int) -> None:
        logged(i)
        if i == 500:  # from a worker, while both lanes are busy
            second.weight = 3.0
            marks.append(len(log.items))  # once it applies: the worker may be held up between the two

    with held(pool):
        first.parallel(log.work(clock, "first", 1.0), 1_000_000)
        second.parallel(reweigh, 1_000_000)
    log.wait([first, second])
    pool.close()
    before, after = log.shares(units=800), log.shares(start=marks[0] + 8, units=1500)
    assert before["second"] / before["first"] == pytest.approx(1.0, rel=0.15), before
    assert after["second"] / after["first"] == pytest.approx(3.0, rel=0.15), after


@pytest.mark.parametrize("weight", [0.0, -1.0, float("nan"), float("inf")])
def test_a_weight_must_be_a_positive_number(weight):
    pool = FairPool(1, name="t-bad-weight")
    with pytest.raises(ConfigError, match="weight"):
        pool.lane("x", weight=weight)
    lane = pool.lane("y")
    with pytest.raises(ConfigError, match="weight"):
        lane.weight = weight
    assert lane.weight == 1.0
    pool.close()


def test_a_lane_back_after_a_long_idle_takes_its_share_not_the_pool():
    clock = WorkClock()
    pool = FairPool(2, name="t-idle", clock=clock)
    log = WorkLog(units=3000)
    busy, away = pool.lane("busy"), pool.lane("away")
    away.run(log.work(clock, "away-before", 1.0), 10)  # it had work, then none for 1000 units
    back_at: list[int] = []

    def busy_work(i: int) -> None:
        log.work(clock, "busy", 1.0)(i)
        if i == 1000:  # the idle lane gets work again while this one keeps the pool busy
            away.parallel(log.work(clock, "away", 1.0), 1_000_000)
            # Counted from once it has work: a worker held up before handing it over
            # would see the other run the busy lane's items alone meanwhile.
            back_at.append(len(log.items))

    busy.parallel(busy_work, 1_000_000)
    log.wait([busy, away])
    pool.close()
    shares = log.shares(start=back_at[0], units=200)  # right after it came back
    assert 0.35 <= shares["away"] / 200 <= 0.65, shares  # no burst for the 1000 units it was away


def test_items_running_are_charged_when_claimed_and_corrected_when_done():
    clock = WorkClock()
    pool = FairPool(2, name="t-charge", clock=clock)
    lane = pool.lane("x", weight=2.0)
    lane.run(lambda i: clock.spend(1.0), 1)  # its mean item time: 1 unit
    assert lane.virtual_s == pytest.approx(0.5)
    started, gate = threading.Semaphore(0), threading.Event()

    def slow(i: int) -> None:
        started.release()
        gate.wait(10)
        clock.spend(3.0)

    loop = lane.parallel(slow, 2)
    assert started.acquire(timeout=10) and started.acquire(timeout=10)  # both running
    assert lane.virtual_s == pytest.approx(0.5 + 2 * 1.0 / 2.0)  # paid for both at their claim
    gate.set()
    loop.wait()
    assert lane.virtual_s == pytest.approx(0.5 + 2 * 3.0 / 2.0)  # what they took
    assert lane.busy_s == pytest.approx(7.0)
    pool.close()


def _working_at_once(pool: FairPool, expected: int, items: int = 24) -> int:
    """How many of ``pool``'s workers run items at the same moment, at most: the
    items wait (up to 30 s) until ``expected`` run at once, then hold on a moment, in
    which a worker beyond those would take one too."""
    cond, now, most = threading.Condition(), [0], [0]

    def work(i: int) -> None:
        with cond:
            now[0] += 1
            most[0] = max(most[0], now[0])
            cond.notify_all()
            cond.wait_for(lambda: most[0] >= expected, timeout=30)
        time.sleep(0.02)
        with cond:
            now[0] -= 1

    pool.lane().run(work, items)
    return most[0]


def test_a_resized_pool_works_on_its_new_number_of_threads_and_lets_the_others_go():
    pool = FairPool(2, name="t-resize")
    assert _working_at_once(pool, 2) == 2
    pool.resize(4)
    assert pool.threads == 4 and _working_at_once(pool, 4) == 4 and _threads("t-resize") == 4
    pool.resize(1)
    assert pool.threads == 1 and _working_at_once(pool, 1) == 1
    deadline = time.monotonic() + 5
    while _threads("t-resize") > 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _threads("t-resize") == 1  # the others stopped once their items had run
    pool.resize(3)  # grows again while none is stopping: new threads
    assert _working_at_once(pool, 3) == 3
    assert pool.busy_s > 0
    pool.close()


def test_a_pool_grown_again_while_letting_workers_go_ends_with_its_new_number():
    pool = FairPool(4, name="t-regrow")
    pool.resize(1)
    pool.resize(4)  # those told to stop and not stopped yet stay; the others are replaced
    assert _working_at_once(pool, 4) == 4
    deadline = time.monotonic() + 1
    while time.monotonic() < deadline and _threads("t-regrow") > 4:
        time.sleep(0.01)
    assert _threads("t-regrow") == 4
    pool.close()


def test_each_lane_is_charged_the_cpu_its_own_items_took_by_the_time_its_loop_ends():
    pool = FairPool(2, name="t-cpu")
    light, heavy = pool.lane("light"), pool.lane("heavy")
    took: dict[str, float] = {"light": 0.0, "heavy": 0.0}
    lock = threading.Lock()

    def burning(name: str, cpu_s: float):
        def work(i: int) -> None:
            started = time.thread_time()
            while time.thread_time() - started < cpu_s:
                pass
            with lock:
                took[name] += time.thread_time() - started
        return work

    try:
        for _ in range(3):  # the lanes' loops interleave item by item on both workers
            loops = [light.parallel(burning("light", 0.001), 16), heavy.parallel(burning("heavy", 0.01), 16)]
            for loop in loops:
                loop.wait()
        assert light.cpu_s >= took["light"] and heavy.cpu_s >= took["heavy"], "every item's CPU, when its loop ends"
        assert light.cpu_s < took["light"] + 0.5 * took["heavy"] / 16, "none of the other lane's items"
    finally:
        pool.close()
