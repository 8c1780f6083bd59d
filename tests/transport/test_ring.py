"""A stream's slot bookkeeping alone: loans with generations, releases that must name
the current one, a producer woken by a release, a reclaim hook, and close."""

from __future__ import annotations

import threading
import time

import pytest

from core.errors import InvalidArgument
from transport.base import TransportClosed
from transport.ring import SlotRing


def test_every_slot_is_lent_once_then_acquire_times_out() -> None:
    ring = SlotRing(3, "s")
    loans = [ring.acquire(0) for _ in range(3)]
    assert sorted(index for index, _ in loans) == [0, 1, 2] and all(g == 1 for _, g in loans)
    assert ring.acquire(0.05) is None


def test_a_release_names_the_current_loan_or_is_refused() -> None:
    ring = SlotRing(1, "s")
    index, generation = ring.acquire(0)
    with pytest.raises(InvalidArgument, match="stream s slot 5: no such slot"):
        ring.release(5, generation)
    with pytest.raises(InvalidArgument, match="generation 2: not lent"):
        ring.release(index, generation + 1)
    ring.release(index, generation)
    with pytest.raises(InvalidArgument, match="not lent \\(released twice\\?\\)"):
        ring.release(index, generation)
    again = ring.acquire(0)
    assert again == (index, generation + 1)
    with pytest.raises(InvalidArgument, match="stale generation 1 \\(current 2\\)"):
        ring.release(index, generation)


def test_a_waiting_producer_is_woken_by_a_release() -> None:
    ring = SlotRing(1, "s")
    index, generation = ring.acquire(0)
    got: list[tuple[int, int] | None] = []
    waiting = threading.Thread(target=lambda: got.append(ring.acquire(10)))
    waiting.start()
    time.sleep(0.05)
    ring.release(index, generation)
    waiting.join(5)
    assert got == [(index, generation + 1)]


def test_a_ring_with_a_reclaim_hook_takes_back_what_the_client_gave_back_without_a_call() -> None:
    given_back: set[tuple[int, int]] = set()

    class Words(SlotRing):
        def reclaim(self, index: int, generation: int) -> bool:
            return (index, generation) in given_back

    ring = Words(2, "s", poll_s=0.01)
    first, second = ring.acquire(0), ring.acquire(0)
    assert ring.acquire(0.03) is None
    given_back.add(second)
    assert ring.acquire(1) == (second[0], second[1] + 1)
    assert first is not None


def test_close_wakes_producers_and_ends_releases() -> None:
    ring = SlotRing(1, "s")
    index, generation = ring.acquire(0)
    errors: list[BaseException] = []

    def produce() -> None:
        try:
            ring.acquire(10)
        except TransportClosed as e:
            errors.append(e)

    waiting = threading.Thread(target=produce)
    waiting.start()
    time.sleep(0.05)
    assert ring.close() and not ring.close()
    waiting.join(5)
    assert len(errors) == 1 and "s: ring closed" in str(errors[0])
    ring.release(index, generation)  # the stream is over: nothing to refuse
    with pytest.raises(TransportClosed):
        ring.acquire(0)


def test_a_ring_needs_a_slot() -> None:
    with pytest.raises(ValueError, match="ring of 0 slots"):
        SlotRing(0, "s")
