"""The daemon's tuner against a sweep of hand-set options: images/s of ``feeder
serve`` left to tune itself (no ``--threads``, no ``--prefetch``) over its first
minute, against the best of every ``--threads`` x ``--prefetch`` setting given by
hand, on the same data in one run.

Scenarios (the bench's sample data, train augmentation, shared memory, one client
process per stream, each reading as fast as it can):

- ``one-224``: one stream, 224 px, batch 64;
- ``one-128``: one stream, 128 px, batch 256;
- ``ranks-4``: one job of 4 local ranks, 224 px, batch 64 each;
- ``jobs-2``: two jobs of one rank each sharing the daemon, 224 px, batch 64.

Each run starts a fresh daemon, opens every stream, then counts the images all
clients take. A hand-set run is measured over ``--seconds`` after ``--warmup``. The
sweep finds the best setting; then ``--rounds`` times a tuned run and the best
setting again, one beside the other. A tuned run is measured over the
``--tuned-seconds`` that end 60 s (``--tuned-by``) after its streams opened, and over
the ``--seconds`` after that. ``x_best``: the tuned runs' median over the best
setting's median (its sweep run and its runs again; target >= 0.95);
``x_best_after``: the same after the minute. The tuner's log lines are kept with
the time they came.

Usage::

    python bench/autotune.py --json bench/results/autotune.json
"""

from __future__ import annotations

import argparse
import bisect
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: python bench/autotune.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import prepare_sample  # noqa: E402
from bench.report import write_document  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402

__all__ = ["SCENARIOS", "Scenario", "main", "parse_args", "rate_between"]

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".bench"


@dataclass(frozen=True)
class Scenario:
    image_size: int
    batch_size: int
    ranks: int = 1  # local ranks of one job
    jobs: int = 1  # jobs of one rank each

    @property
    def clients(self) -> list[tuple[int, int]]:
        """(rank, job) of each client process."""
        return [(rank, job) for job in range(self.jobs) for rank in range(self.ranks)]


SCENARIOS = {
    "one-224": Scenario(224, 64),
    "one-128": Scenario(128, 256),
    "ranks-4": Scenario(224, 64, ranks=4),
    "jobs-2": Scenario(224, 64, jobs=2),
}


def _client(address: str, scenario: Scenario, rank: int, job: int, seed: int, seconds: float,
            ready, go, start, out) -> None:  # type: ignore[no-untyped-def]
    """One client process: opens its stream, says so, and once told to go records
    (seconds since the go, images taken so far) after every batch for ``seconds``."""
    from clients import FeederLoader

    loader = FeederLoader("bench", address=address, split="train", batch_size=scenario.batch_size,
                          image_size=scenario.image_size, seed=seed, normalize=False, augment="train",
                          transport="shm", rank=rank, world_size=scenario.ranks, job_id=f"job-{job}")
    with loader:
        def endless():  # type: ignore[no-untyped-def]
            while True:
                yield from loader

        batches = endless()
        next(batches)
        ready.put(rank)
        go.wait()
        images, times, counts = 0, [0.0], [0]
        while times[-1] < seconds:
            batch, _ = next(batches)
            images += len(batch)
            times.append(time.time() - start.value)
            counts.append(images)
    out.put((times, counts))


def rate_between(records: list[tuple[list[float], list[int]]], begin_s: float, end_s: float) -> float:
    """Images/s all clients took between ``begin_s`` and ``end_s`` (each client's count
    at a moment: what it had taken by its last batch before it)."""
    def at(times: list[float], counts: list[int], moment: float) -> int:
        return counts[max(0, bisect.bisect_right(times, moment) - 1)]

    taken = sum(at(t, c, end_s) - at(t, c, begin_s) for t, c in records)
    return taken / (end_s - begin_s)


def _run(shards: Path, scenario: Scenario, options: tuple[str, ...], seconds: float,
         args: argparse.Namespace) -> tuple[list[tuple[list[float], list[int]]], list[tuple[float, str]]]:
    """One daemon with ``options`` and the scenario's clients for ``seconds``: each
    client's records, and the tuner's log lines with their times."""
    context = mp.get_context("spawn")
    ready, out = context.Queue(), context.Queue()
    go, start = context.Event(), context.Value("d", 0.0)
    lines: list[tuple[float, str]] = []

    def echo(line: str) -> None:
        if "autotune:" in line:
            lines.append((round(time.time() - start.value, 1) if start.value else 0.0, line.split("autotune: ")[-1]))

    options = ("--device", "cpu", "--max-batch-size", str(scenario.batch_size), *options)
    with DaemonProcess({"bench": shards}, options, echo=echo) as daemon:
        clients = [context.Process(target=_client, args=(daemon.address, scenario, rank, job, args.seed, seconds,
                                                           ready, go, start, out), daemon=True)
                   for rank, job in scenario.clients]
        for c in clients:
            c.start()
        for _ in clients:
            ready.get(timeout=300)
        start.value = time.time()
        go.set()
        records = [out.get(timeout=seconds + 300) for _ in clients]
        for c in clients:
            c.join(timeout=30)
    return records, lines


def _tuned(name: str, shards: Path, scenario: Scenario, args: argparse.Namespace) -> dict:
    """One run left to tune itself: its rates before, over and after the window
    that ends ``--tuned-by`` seconds after its streams opened, and its log lines."""
    by_s, window_s = args.tuned_by, args.tuned_seconds
    records, lines = _run(shards, scenario, (), by_s + args.seconds, args)
    tuned = {"images_per_s": round(rate_between(records, by_s - window_s, by_s), 1),
             "images_per_s_after": round(rate_between(records, by_s, by_s + args.seconds), 1),
             "images_per_s_until_then": round(rate_between(records, 0.0, by_s), 1), "log": lines}
    print(f"autotune: {name} tuned: {tuned}", flush=True)
    return tuned


def _hand_set(name: str, shards: Path, scenario: Scenario, threads: int, prefetch: int,
              args: argparse.Namespace) -> dict:
    end_s = args.warmup + args.seconds
    records, _ = _run(shards, scenario, ("--threads", str(threads), "--prefetch", str(prefetch)), end_s, args)
    rate = rate_between(records, args.warmup, end_s)
    row = {"threads": threads, "prefetch": prefetch, "images_per_s": round(rate, 1)}
    print(f"autotune: {name} {row}", flush=True)
    return row


def _scenario(name: str, shards: Path, args: argparse.Namespace) -> dict:
    """The sweep, its best setting, then ``--rounds`` of (tuned run, best setting
    again), so the two compared ran next to each other."""
    scenario = SCENARIOS[name]
    swept = [_hand_set(name, shards, scenario, t, p, args) for t in args.threads for p in args.prefetch]
    best = max(swept, key=lambda r: r["images_per_s"])
    rounds = []
    for _ in range(args.rounds):
        tuned = _tuned(name, shards, scenario, args)
        again = _hand_set(name, shards, scenario, best["threads"], best["prefetch"], args)
        rounds.append({"tuned": tuned, "best_again": again["images_per_s"]})
    tuned_rate = statistics.median(r["tuned"]["images_per_s"] for r in rounds)
    after_rate = statistics.median(r["tuned"]["images_per_s_after"] for r in rounds)
    best_rate = statistics.median([best["images_per_s"], *(r["best_again"] for r in rounds)])
    summary = {"images_per_s": tuned_rate, "images_per_s_after": after_rate, "best_images_per_s": best_rate,
               "x_best": round(tuned_rate / best_rate, 3), "x_best_after": round(after_rate / best_rate, 3)}
    return {"scenario": name, **asdict(scenario), "tuned": summary, "best": best, "sweep": swept, "rounds": rounds}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sample data is made once")
    p.add_argument("--scenarios", type=lambda s: s.split(","), default=list(SCENARIOS), help="comma-separated")
    p.add_argument("--threads", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 3],
                   help="--threads values of the sweep")
    p.add_argument("--prefetch", type=lambda s: [int(v) for v in s.split(",")], default=[1, 2, 4],
                   help="--prefetch values of the sweep")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--warmup", type=float, default=4.0, help="seconds before a hand-set run is measured")
    p.add_argument("--tuned-by", type=float, default=60.0,
                   help="a tuned run is measured over the --tuned-seconds that end this long after its streams opened")
    p.add_argument("--tuned-seconds", type=float, default=20.0, help="measured seconds of a tuned run")
    p.add_argument("--rounds", type=int, default=2, help="tuned runs, each beside the best setting again")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shards = prepare_sample(args.cache, args.seed).shards
    rows = [_scenario(name, shards, args) for name in args.scenarios]
    for row in rows:
        print(row["scenario"], "tuned", row["tuned"]["images_per_s"], "best", row["best"], "x_best",
              row["tuned"]["x_best"], flush=True)
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        write_document(args.json, {"bench": "autotune", "command": sys.argv, "config": config,
                                   "cpus": len(os.sched_getaffinity(0)), "rows": rows})


if __name__ == "__main__":
    main()
