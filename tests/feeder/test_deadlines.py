"""Deadlines on one thread: a callback runs when its time comes unless cleared first."""

from __future__ import annotations

import threading

from feeder.deadlines import Deadlines


def test_a_callback_runs_at_its_deadline_and_a_cleared_one_never():
    deadlines = Deadlines("test-deadlines")
    fired, kept = threading.Event(), threading.Event()
    try:
        late = deadlines.add(0.2, fired.set)
        early = deadlines.add(0.1, kept.set)
        assert deadlines.clear(early), "cleared before its time"
        assert fired.wait(10)
        assert not deadlines.clear(late), "its callback has run"
        assert not kept.wait(0.3)
    finally:
        deadlines.close()


def test_deadlines_fire_in_time_order_whatever_the_order_added():
    deadlines = Deadlines("test-deadlines")
    order: list[int] = []
    done = threading.Event()
    try:
        deadlines.add(0.3, lambda: (order.append(3), done.set()))
        deadlines.add(0.1, lambda: order.append(1))
        deadlines.add(0.2, lambda: order.append(2))
        assert done.wait(10)
        assert order == [1, 2, 3]
    finally:
        deadlines.close()


def test_many_cleared_deadlines_do_not_pile_up():
    deadlines = Deadlines("test-deadlines")
    try:
        for _ in range(5000):
            assert deadlines.clear(deadlines.add(60.0, lambda: None))
        assert len(deadlines._due) <= 1025  # compacted: cleared ones dropped long before they are due
    finally:
        deadlines.close()


def test_a_failing_callback_does_not_stop_the_others():
    deadlines = Deadlines("test-deadlines")
    after = threading.Event()
    try:
        deadlines.add(0.05, lambda: 1 / 0)
        deadlines.add(0.1, after.set)
        assert after.wait(10)
    finally:
        deadlines.close()
