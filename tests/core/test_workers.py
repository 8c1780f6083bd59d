"""The shared worker pool: a fixed number of threads, fair shares between lanes."""

from __future__ import annotations

import gc
import threading
import time

import pytest

from core.workers import FairPool, PoolClosed


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
    pool = FairPool(2, name="t-fair")
    small, big = pool.lane("small"), pool.lane("big")
    stop = time.monotonic() + 1.5

    def client(lane, count):  # two loops in flight, as a stream's prefetch keeps them
        ahead = lane.parallel(lambda i: time.sleep(0.002), count)
        while time.monotonic() < stop:
            loop = lane.parallel(lambda i: time.sleep(0.002), count)
            ahead.wait()
            ahead = loop
        ahead.wait()

    clients = [threading.Thread(target=client, args=(small, 2)), threading.Thread(target=client, args=(big, 64))]
    for c in clients:
        c.start()
    for c in clients:
        c.join()
    pool.close()
    assert small.busy_s / big.busy_s == pytest.approx(1.0, rel=0.25)


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
