"""The tuner's decisions (decode.autotune.Tuner) on streams and a pool whose counters
the test moves: what it tries, what it keeps, what it undoes and when it waits."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass, field

import pytest

from decode.autotune import BACKOFF_S, MAX_PREFETCH, Tuner, idle_cpu_s

INTERVAL_S = 3.0


@dataclass(eq=False)
class FakeStream:
    label: str
    samples_sent: int = 0
    starved_s: float = 0.0
    consumer_wait_s: float = 0.0  # not the tuner's to read: the consumer's own slowness
    prefetch: int = 2


@dataclass
class FakePool:
    threads: int = 2
    busy_s: float = 0.0

    def resize(self, threads: int) -> None:
        self.threads = threads


@dataclass
class Gauges:
    threads: list[int] = field(default_factory=list)
    prefetch: list[tuple[str, int]] = field(default_factory=list)

    def tuned_threads(self, threads: int) -> None:
        self.threads.append(threads)

    def tuned_prefetch(self, stream: str, runs: int) -> None:
        self.prefetch.append((stream, runs))


class Node:
    """Two CPUs, a pool, streams; :meth:`run` moves their counters one interval at a
    time at the rate ``rate(pool, streams)`` says."""

    def __init__(self, streams: int = 1, threads: int | None = 2, prefetch: bool = True, room: bool = True) -> None:
        self.now = self.cpu = self.idle = 0.0
        self.pool = FakePool(threads or 2)
        self.streams = [FakeStream(str(i)) for i in range(streams)]
        self.gauges = Gauges()
        self.room = room
        self.tuner = Tuner(lambda: list(self.streams), self.gauges, cpus=2, pool=self.pool,
                           tune_threads=threads is not None, grant=self._grant if prefetch else None,
                           interval_s=INTERVAL_S,
                           clock=lambda: self.now, cpu_clock=lambda: self.cpu, idle_clock=lambda: self.idle)

    def _grant(self, stream: FakeStream, runs: int) -> bool:  # type: ignore[override]
        if self.room:
            stream.prefetch = runs
        return self.room

    def run(self, intervals: int, rate: Callable[[Node], float], busy: float = 0.95, waiting: float = 0.5,
            cpus_used: float = 1.2, held: float = 0.0) -> None:
        """``waiting``: share of each interval the consumers were starved; ``held``:
        the share their batches waited for them (a slow consumer)."""
        for _ in range(intervals):
            self.now += INTERVAL_S
            self.cpu += cpus_used * INTERVAL_S
            self.idle += max(0.0, 2 - cpus_used) * INTERVAL_S  # nothing else runs on the node
            self.pool.busy_s += busy * self.pool.threads * INTERVAL_S
            for stream in self.streams:
                stream.samples_sent += int(rate(self) * INTERVAL_S / len(self.streams))
                stream.starved_s += waiting * INTERVAL_S
                stream.consumer_wait_s += held * INTERVAL_S
            self.tuner.tick()


def threads_help(node: Node) -> float:
    """Each thread adds 500 images/s up to 4 (items that wait on reads)."""
    return 500.0 * min(node.pool.threads, 4)


def flat(node: Node) -> float:
    return 1000.0


def test_the_idle_cpu_time_is_read_from_the_kernel_for_this_process_cpus(tmp_path) -> None:
    stat = tmp_path / "stat"
    cpus = sorted(os.sched_getaffinity(0))
    lines = ["cpu  1 2 3 400 50 6 7 8 9 10"]
    lines += [f"cpu{c} 1 2 3 {100 * (i + 1)} 10 6 7 8 9 10" for i, c in enumerate(cpus)]
    stat.write_text("\n".join(lines) + "\nintr 5\n")
    ticks = sum(100 * (i + 1) + 10 for i in range(len(cpus)))
    assert idle_cpu_s(str(stat)) == pytest.approx(ticks / os.sysconf("SC_CLK_TCK"))
    assert idle_cpu_s(str(tmp_path / "missing")) == 0.0
    assert idle_cpu_s() > 0  # this machine's


def test_a_daemon_whose_consumers_never_wait_is_left_as_it_is() -> None:
    node = Node()
    node.run(20, threads_help, waiting=0.0)
    assert node.pool.threads == 2 and node.streams[0].prefetch == 2


def test_consumers_slow_to_take_their_batches_are_not_what_the_daemon_tunes_for() -> None:
    # A consumer sleeping between batches over shared memory: its batches wait 96 % of
    # the time for it (the ring's slots held by the client), the pool 4 % busy.
    node = Node()
    node.run(20, flat, busy=0.04, waiting=0.0, held=0.96, cpus_used=0.1)
    assert node.gauges.prefetch == [] and node.gauges.threads == [2]  # nothing tried
    assert node.pool.threads == 2 and node.streams[0].prefetch == 2


def test_threads_are_added_while_each_one_more_lifts_the_rate_and_the_one_that_does_not_is_undone() -> None:
    node = Node()
    node.run(20, threads_help)
    # 3 and 4 lift the rate by 50 % and 33 %, each kept; nothing above 2 x CPUs is tried.
    assert node.gauges.threads == [2, 3, 4] and node.pool.threads == 4


def test_a_move_that_did_not_pay_waits_its_back_off_which_doubles() -> None:
    node = Node()
    node.run(3, flat)  # two intervals' rates, then the trial: 2 -> 3
    assert node.pool.threads == 3
    node.run(1, flat)
    assert node.pool.threads == 3  # judged over two intervals
    node.run(1, flat)  # no gain: undone
    assert node.pool.threads == 2
    tried = len(node.gauges.threads)
    node.run(int(BACKOFF_S // INTERVAL_S) - 1, flat)
    assert len(node.gauges.threads) == tried  # not within its back-off
    node.run(4, flat)
    assert len(node.gauges.threads) == tried + 2  # tried and undone once more
    node.run(int(BACKOFF_S // INTERVAL_S) + 2, flat)
    assert len(node.gauges.threads) == tried + 2  # the back-off is now twice as long


def test_an_interval_without_a_batch_delivered_judges_nothing_and_changes_nothing() -> None:
    node = Node()
    node.run(10, lambda n: 0.0, waiting=1.0)  # streams starting up: consumers wait, nothing comes
    assert node.gauges.threads == [2] and node.pool.threads == 2


def test_a_stream_opening_undoes_the_trial_under_way_and_the_rates_start_over() -> None:
    node = Node()
    node.run(3, flat)
    assert node.pool.threads == 3
    node.streams.append(FakeStream("new"))
    node.run(1, flat)
    assert node.pool.threads == 2  # undone, not judged against a rate of other streams
    node.run(1, flat)
    assert node.pool.threads == 2  # two fresh intervals measured first
    node.run(1, flat)
    assert node.pool.threads == 3  # back-offs cleared: tried again for the new streams


def test_an_idle_pool_gives_the_stream_waiting_longest_a_run_more_in_flight() -> None:
    node = Node(streams=2)
    first, second = node.streams

    def rate(n: Node) -> float:
        return 400.0 * (first.prefetch + second.prefetch)

    node.now += INTERVAL_S
    node.tuner.tick()  # both streams seen once
    first.starved_s += 1.0  # the first was starved longer than the second
    node.run(3, rate, busy=0.5)
    assert (first.prefetch, second.prefetch) == (3, 2)
    node.run(40, rate, busy=0.5)
    assert (first.prefetch, second.prefetch) == (MAX_PREFETCH, MAX_PREFETCH)
    assert ("0", 3) in node.gauges.prefetch


def test_a_run_more_without_room_in_the_memory_budget_is_not_set() -> None:
    node = Node(room=False)
    node.run(10, flat, busy=0.5)
    assert node.streams[0].prefetch == 2 and node.gauges.prefetch == []


def test_more_threads_than_cpus_on_saturated_cpus_are_taken_back() -> None:
    node = Node(threads=4)
    node.run(3, flat, cpus_used=1.95)
    assert node.pool.threads == 3
    node.run(1, lambda n: 1100.0, cpus_used=1.95)
    assert node.pool.threads == 3  # kept: it paid
    node.run(8, lambda n: 1100.0 if n.pool.threads >= 3 else 600.0, cpus_used=1.95)
    assert node.pool.threads == 3  # 2 does not: undone, and never below the CPUs by this move


def test_knobs_given_by_hand_are_not_tuned() -> None:
    node = Node(threads=None, prefetch=False)
    assert not node.tuner.tuning
    node.run(20, threads_help, busy=0.5)
    assert node.pool.threads == 2 and node.streams[0].prefetch == 2
    assert node.gauges.threads == [2]  # shown as given, never changed


def test_threads_given_by_hand_leave_the_prefetch_tuned() -> None:
    node = Node(threads=None)
    node.run(20, lambda n: 500.0 * n.streams[0].prefetch, busy=0.95)
    assert node.pool.threads == 2 and node.streams[0].prefetch == 2  # busy pool: prefetch is not what holds it
    node.run(20, lambda n: 500.0 * n.streams[0].prefetch, busy=0.5)
    assert node.streams[0].prefetch == MAX_PREFETCH and node.gauges.threads == [2]  # shown as given


def test_one_lucky_interval_after_a_change_does_not_keep_it() -> None:
    node = Node()
    node.run(3, flat)
    assert node.pool.threads == 3
    node.run(1, lambda n: 1200.0)  # noise: 20 % up
    node.run(1, lambda n: 850.0)  # and down: no better over both
    assert node.pool.threads == 2


def test_a_busy_pool_without_cpu_to_spare_tries_a_run_less_for_every_stream_and_keeps_it_if_it_pays() -> None:
    node = Node(streams=4)

    def rate(n: Node) -> float:  # one run each delivers 19 % more than two on the busy threads
        return 1900.0 if all(s.prefetch == 1 for s in n.streams) else 1600.0

    node.run(4, rate, cpus_used=1.95)
    assert [s.prefetch for s in node.streams] == [1, 1, 1, 1]
    node.run(3, rate, cpus_used=1.95)
    assert [s.prefetch for s in node.streams] == [1, 1, 1, 1]  # kept
    assert sorted(node.gauges.prefetch) == sorted((str(i), 1) for i in range(4))


def test_a_run_less_that_costs_is_given_back_to_every_stream() -> None:
    node = Node(streams=2)
    node.run(6, lambda n: 1000.0 if n.streams[0].prefetch == 2 else 900.0, cpus_used=1.95)
    assert [s.prefetch for s in node.streams] == [2, 2]
    assert ("0", 1) in node.gauges.prefetch and node.gauges.prefetch[-1][1] == 2


def test_a_run_less_that_delivers_as_fast_is_kept_for_the_buffers_it_frees() -> None:
    node = Node(streams=2)
    node.run(8, lambda n: 1000.0 if n.streams[0].prefetch == 2 else 970.0, cpus_used=1.95)  # within noise
    assert [s.prefetch for s in node.streams] == [1, 1]


def test_a_lone_stream_with_no_more_runs_than_threads_keeps_its_runs_on_a_busy_pool() -> None:
    node = Node()  # 2 runs in flight, 2 threads: none queued
    node.run(20, flat, cpus_used=1.95)
    assert node.streams[0].prefetch == 2 and node.gauges.prefetch == []
    node.pool.threads = 1  # now one of its runs waits for a thread
    node.run(4, flat, cpus_used=1.95)
    assert node.streams[0].prefetch == 1
