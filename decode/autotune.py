"""The daemon tuning itself: :class:`Tuner` sets the decode threads (``--threads``)
and each stream's pipeline runs in flight (``--prefetch``) where they are not given,
from what the streams measure, and keeps at it while streams open and close.

Every ``interval_s`` it reads what happened since the last time: the images the
streams delivered (their rate is what it climbs), how long their consumers were
starved (waited for a batch the daemon was still making: ``starved_s``; a consumer
slow to take its batches or to hand back its shared-memory slots is its own wait,
not the daemon's, and is not counted), how busy the decode pool's threads were and
how much of the node's CPUs (those this process may run on) stood idle. Where no
consumer was starved (less than ``WAITING`` of the interval), the daemon is not what
the jobs wait on, and it changes nothing. Where one was, it tries, the first that
applies:

- the pool busy (``BUSY`` of its threads' time) with CPU to spare (``SPARE``, half
  a CPU's time idle; 4 client processes on 2 busy cores left 12-16 % of the time
  idle, and a thread more there cost 10-30 %): a thread more (items that wait on something else than the CPU,
  as reads from a store do);
- the pool not busy: a run more in flight for the stream whose consumer was
  starved longest (its decode thread count is not what holds it; the work it hands the pool
  between batches is), if the memory budget has room for it;
- no CPU to spare, with more threads than CPUs: a thread less;
- the pool busy and no CPU to spare, with more runs in flight over the streams than
  the pool has threads: a run less in flight for every stream with more than one
  (runs queued beyond what the threads can take only hold buffers: with 4 streams
  on 2 threads, 1 run each delivered 19 % more than 2; a lone stream on 2 threads
  delivered 10 % less with 1 than with 2, its pool idle between its runs).

Each change is a trial, judged on the next ``TRIAL_INTERVALS`` intervals' rate
against the rate before it (of as many intervals); a rate over a few seconds moves
by some 10 % on a busy node, so one interval would keep a change that did nothing
as often as not. A move that takes more (a thread, a run in flight) is kept when it
beats the rate before by ``GAIN``; one that gives back (a thread, a run's buffers)
is kept unless it falls short of it by ``GAIN``: as fast with less is better, and
asked to pay it would be undone by noise as often as not. Either, undone, is
not tried again for a back-off that doubles each time (``BACKOFF_S``, at most
``MAX_BACKOFF_S``). An interval that delivered no batch judges nothing (a stream
starting up is not a slow one). Streams opening or closing undo the trial under way
(its rate no longer compares) and clear the back-offs: the new streams' best setting
may be another. Each change is one log line and a gauge
(``feeder_tuned_threads``, ``feeder_tuned_prefetch{stream}``).
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

__all__ = [
    "BACKOFF_S", "BUSY", "GAIN", "MAX_BACKOFF_S", "MAX_PREFETCH", "SPARE", "TRIAL_INTERVALS", "WAITING", "Tunable",
    "Tuner", "TunerGauges", "idle_cpu_s",
]

log = logging.getLogger(__name__)

BUSY = 0.85  # share of the pool's thread time busy above which a thread more is tried
WAITING = 0.05  # share of an interval a consumer was starved above which the daemon is the slow side
SPARE = 0.5  # CPUs' worth of the node's time idle from which a thread more may find one
GAIN = 0.05  # how much better than the rate before a trial's rate must be to be kept
TRIAL_INTERVALS = 2  # intervals a setting is measured over, before and after a change
BACKOFF_S = 30.0  # how long a move undone is not tried again, doubled each time
MAX_BACKOFF_S = 480.0
MAX_PREFETCH = 4  # runs in flight per stream, at most (each holds a batch of decoded windows)


class Tunable(Protocol):
    """What a stream offers the tuner (:class:`feeder.stream.BatchStream`)."""

    label: str
    samples_sent: int
    starved_s: float  # seconds its consumer waited for a batch the daemon was still making
    prefetch: int


class Pool(Protocol):
    """The decode pool (:class:`core.workers.FairPool`)."""

    @property
    def threads(self) -> int: ...

    @property
    def busy_s(self) -> float: ...

    def resize(self, threads: int) -> None: ...


class TunerGauges(Protocol):
    """Where tuned values are shown (:class:`feeder.metrics.ServerMetrics`)."""

    def tuned_threads(self, threads: int) -> None: ...

    def tuned_prefetch(self, stream: str, runs: int) -> None: ...


@dataclass(frozen=True)
class _Move:
    knob: str  # "threads" or "prefetch"
    step: int  # +1 or -1
    streams: tuple[Tunable, ...] = ()  # whose prefetch: one, or every one with runs to give


@dataclass
class _Trial:
    move: _Move
    before: list[int]  # the values it changed: the threads, or each stream's prefetch
    rate: float  # images/s before it
    rates: list[float] = field(default_factory=list)  # images/s of its intervals so far


@dataclass
class _Seen:
    """A stream's counters as last read."""

    samples: int
    starved_s: float


@dataclass
class _Interval:
    seconds: float
    images: int
    waiting: dict[Tunable, float] = field(default_factory=dict)  # share of the interval each consumer was starved
    busy: float = 0.0  # share of the pool's thread time busy
    cpus_used: float = 0.0  # by the daemon
    idle: float = 0.0  # share of the node's CPU time idle


class Tuner:
    """Tunes ``pool``'s threads and the streams' prefetch (see the module doc). Call
    :meth:`tick` often (the daemon's watcher does, about once a second); it acts
    once per ``interval_s``. Not thread-safe: one caller.

    Args:
        streams: the streams open now.
        gauges: where the tuned values are shown.
        cpus: the CPUs the daemon may use.
        pool: the decode pool: how busy it is, and its threads.
        tune_threads: whether it tunes the pool's threads (from ``cpus`` up to
            ``2 x cpus``); False: hand-set.
        grant: asks for a stream's prefetch to be set to a value (True: set, its
            memory reserved; False: the budget has no room); None: prefetch
            hand-set, not tuned.
        interval_s: how long each setting is measured.
        clock, cpu_clock, idle_clock: wall seconds, the daemon's CPU seconds, and
            the seconds the node's CPUs stood idle, all of them together
            (:func:`idle_cpu_s`).
    """

    def __init__(
        self, streams: Callable[[], list[Tunable]], gauges: TunerGauges, cpus: int, pool: Pool,
        tune_threads: bool = True, grant: Callable[[Tunable, int], bool] | None = None, interval_s: float = 3.0,
        clock: Callable[[], float] = time.monotonic, cpu_clock: Callable[[], float] = time.process_time,
        idle_clock: Callable[[], float] | None = None,
    ) -> None:
        self._streams, self._gauges, self._cpus = streams, gauges, max(1, cpus)
        self._pool, self._tune_threads, self._grant = pool, tune_threads, grant
        self.interval_s = interval_s
        self._clock, self._cpu_clock, self._idle_clock = clock, cpu_clock, idle_clock or idle_cpu_s
        self._since_s, self._cpu_s, self._idle_s = clock(), cpu_clock(), self._idle_clock()
        self._busy_s = pool.busy_s
        self._seen: dict[Tunable, _Seen] = {}
        self._rates: list[float] = []  # the last intervals' rates at the current setting
        self._trial: _Trial | None = None
        self._backoff: dict[_Move, tuple[float, float]] = {}  # move -> (not before, its next back-off)
        gauges.tuned_threads(pool.threads)  # hand-set threads are shown too

    @property
    def tuning(self) -> bool:
        """Whether anything is tuned (a knob left to it)."""
        return self._tune_threads or self._grant is not None

    def tick(self) -> None:
        """Measure the interval past and act on it, once ``interval_s`` has passed."""
        if not self.tuning or self._clock() - self._since_s < self.interval_s:
            return
        streams = self._streams()
        changed = set(streams) != set(self._seen)
        interval = self._measure(streams)
        if changed:
            self._undo("streams opened or closed")
            self._backoff.clear()
            self._rates.clear()
            return
        if interval.images == 0:  # nothing delivered: nothing to judge by
            return
        rate = interval.images / interval.seconds
        if self._trial is not None:
            self._trial.rates.append(rate)
            if len(self._trial.rates) == TRIAL_INTERVALS:
                self._judge(sum(self._trial.rates) / TRIAL_INTERVALS)
            return
        self._rates = [*self._rates[1 - TRIAL_INTERVALS:], rate]
        if len(self._rates) < TRIAL_INTERVALS or not interval.waiting or max(interval.waiting.values()) < WAITING:
            return
        move = self._next_move(interval)
        if move is not None:
            self._try(move, interval, sum(self._rates) / len(self._rates))

    def _measure(self, streams: list[Tunable]) -> _Interval:
        """What the streams and the pool did since the last reading; the readings
        move on (a stream new since is read from now)."""
        now, cpu_s, idle_s = self._clock(), self._cpu_clock(), self._idle_clock()
        seconds = max(now - self._since_s, 1e-6)
        interval = _Interval(seconds, 0, cpus_used=(cpu_s - self._cpu_s) / seconds,
                             idle=(idle_s - self._idle_s) / (seconds * self._cpus))
        self._since_s, self._cpu_s, self._idle_s = now, cpu_s, idle_s
        busy_s = self._pool.busy_s
        interval.busy = (busy_s - self._busy_s) / (seconds * self._pool.threads)
        self._busy_s = busy_s
        seen: dict[Tunable, _Seen] = {}
        for stream in streams:
            last = self._seen.get(stream)
            seen[stream] = _Seen(stream.samples_sent, stream.starved_s)
            if last is not None:
                interval.images += stream.samples_sent - last.samples
                interval.waiting[stream] = (stream.starved_s - last.starved_s) / seconds
        self._seen = seen
        return interval

    def _next_move(self, interval: _Interval) -> _Move | None:
        """The first move that applies and is not backing off (see the module doc)."""
        moves: list[_Move] = []
        spare = interval.idle * self._cpus >= SPARE
        threads = self._pool.threads if self._tune_threads else 0
        if threads and interval.busy >= BUSY and spare and threads < 2 * self._cpus:
            moves.append(_Move("threads", +1))
        if self._grant is not None and interval.busy < BUSY:
            waiting = sorted(interval.waiting, key=interval.waiting.__getitem__, reverse=True)
            moves.extend(_Move("prefetch", +1, (s,)) for s in waiting
                         if interval.waiting[s] >= WAITING and s.prefetch < MAX_PREFETCH)
        if threads and not spare and threads > self._cpus:
            moves.append(_Move("threads", -1))
        giving = tuple(s for s in self._seen if s.prefetch > 1)
        queued = sum(s.prefetch for s in self._seen) > self._pool.threads  # runs no thread can take yet
        if self._grant is not None and interval.busy >= BUSY and not spare and giving and queued:
            moves.append(_Move("prefetch", -1, giving))  # more runs than the busy pool can use
        now = self._clock()
        return next((m for m in moves if self._backoff.get(m, (0.0, 0.0))[0] <= now), None)

    def _values(self, move: _Move) -> list[int]:
        return [s.prefetch for s in move.streams] if move.streams else [self._pool.threads]

    def _set(self, move: _Move, values: list[int]) -> bool:
        """Set what ``move`` changes to ``values``; False (and nothing changed) where
        the memory budget has no room for a stream's runs."""
        if not move.streams:
            self._pool.resize(values[0])
            self._busy_s = self._pool.busy_s
            self._gauges.tuned_threads(values[0])
            return True
        if self._grant is None:
            return False
        done: list[tuple[Tunable, int]] = []
        for stream, value in zip(move.streams, values):
            if stream not in self._seen:
                continue  # closed since
            before = stream.prefetch
            if not self._grant(stream, value):
                for other, runs in done:
                    self._grant(other, runs)
                return False
            done.append((stream, before))
            self._gauges.tuned_prefetch(stream.label, value)
        return True

    def _try(self, move: _Move, interval: _Interval, rate: float) -> None:
        before = self._values(move)
        after = [v + move.step for v in before]
        if not self._set(move, after):
            self._back_off(move)  # no room for it now
            return
        self._trial = _Trial(move, before, rate)
        log.info("autotune: %s %s (pool %.0f %% busy, node %.0f %% idle, daemon %.1f of %d CPUs, consumers "
                 "starved up to %.0f %%, %.0f images/s)", _name(move), _change(before, after), 100 * interval.busy,
                 100 * interval.idle, interval.cpus_used, self._cpus, 100 * max(interval.waiting.values()), rate)

    def _judge(self, rate: float) -> None:
        trial, self._trial = self._trial, None
        assert trial is not None
        after = [v + trial.move.step for v in trial.before]
        if rate >= trial.rate * (1 + GAIN if trial.move.step > 0 else 1 - GAIN):  # see the module doc
            log.debug("autotune: %s %s kept (%.0f images/s against %.0f)", _name(trial.move),
                      _change(trial.before, after), rate, trial.rate)
            self._backoff.pop(trial.move, None)
            self._rates = trial.rates
            return
        self._set(trial.move, trial.before)
        wait_s = self._back_off(trial.move)
        self._rates.clear()
        log.info("autotune: %s %s, undone (%.0f images/s against %.0f before); not tried again for %.0f s",
                 _name(trial.move), _change(after, trial.before), rate, trial.rate, wait_s)

    def _undo(self, why: str) -> None:
        """Undo the trial under way, if any (``why``: for the log); streams closed
        since are left as they are."""
        trial, self._trial = self._trial, None
        if trial is None:
            return
        self._set(trial.move, trial.before)
        after = [v + trial.move.step for v in trial.before]
        log.info("autotune: %s %s, undone (%s)", _name(trial.move), _change(after, trial.before), why)

    def _back_off(self, move: _Move) -> float:
        """Keep ``move`` from being tried for its back-off, doubled for next time; the back-off."""
        wait_s = self._backoff.get(move, (0.0, BACKOFF_S))[1]
        self._backoff[move] = (self._clock() + wait_s, min(2 * wait_s, MAX_BACKOFF_S))
        return wait_s


def idle_cpu_s(stat: str = "/proc/stat") -> float:
    """Seconds the CPUs this process may run on have stood idle (idle and I/O wait)
    since boot, all together; 0 where the kernel does not say."""
    mine = {f"cpu{cpu}" for cpu in os.sched_getaffinity(0)}
    try:
        with open(stat) as f:
            rows = [line.split() for line in f if line.startswith("cpu")]
    except OSError:
        return 0.0
    ticks = sum(int(row[4]) + int(row[5]) for row in rows if row[0] in mine and len(row) > 5)
    return ticks / os.sysconf("SC_CLK_TCK")


def _name(move: _Move) -> str:
    if not move.streams:
        return "threads"
    if len(move.streams) == 1:
        return f"stream {move.streams[0].label} prefetch"
    return f"prefetch of {len(move.streams)} streams"


def _change(before: list[int], after: list[int]) -> str:
    """``2 -> 3``, or for several values ``[2, 2] -> [1, 1]``."""
    if len(before) == 1:
        return f"{before[0]} -> {after[0]}"
    return f"{before} -> {after}"
