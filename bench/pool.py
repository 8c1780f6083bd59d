"""A rank fed by a pool of daemons: images/s of one FeederLoader drawing from N
``feeder serve`` processes, each confined to ``--daemon-cpus`` of a core by a CPU
quota (a cgroup, as a container limit is), for each N of ``--pool``; the scaling
efficiency against one daemon, and the consumer's own CPU per image. ``--kill``
also runs a pool of 3, SIGKILLs one daemon mid-run and reports the training loop's
longest wait for a batch after it, and whether every sample of the epochs came once.
``--as-needed`` runs ``pool="as-needed"`` over 2 daemons: how soon it takes the second
while the consumer is never the limit, its images/s then against one daemon's, the
daemons in use at every epoch's end (each epoch checked whole), and how soon it goes
back to one daemon once the consumer slows to a quarter of that rate.

Needs root and a writable cgroup (v1 ``cpu`` controller or v2 ``cpu.max``); without
one the daemons run unconfined, and the report says so.

Example::

    python bench/pool.py --pool 1,2,4 --daemon-cpus 0.25 --kill --json bench/results/pool.json
"""

from __future__ import annotations

import argparse
import os
import resource
import signal
import statistics
import sys
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_quota import CpuQuota  # noqa: E402
from bench.data import prepare_sample  # noqa: E402
from bench.report import write_document  # noqa: E402
from clients import FeederLoader  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402

__all__ = ["main", "parse_args"]

_REPO = Path(__file__).resolve().parent.parent


@contextmanager
def _daemons(shards: Path, count: int, cpus: float, threads: int, batch: int) -> Iterator[tuple[list[str], list]]:
    """``count`` daemons, each in a quota of its own; yields their addresses and the
    processes. The quota is ``None`` where no cgroup can be made."""
    with ExitStack() as stack:
        procs = []
        for i in range(count):
            quota: CpuQuota | None = None
            try:
                quota = CpuQuota(f"feeder-bench-pool-{os.getpid()}-{i}", cpus)
                stack.callback(quota.remove)  # once its daemon has stopped (the stack runs backwards)
            except OSError as e:
                print(f"pool: no CPU quota ({e}); daemon {i} runs unconfined", file=sys.stderr)
            daemon = stack.enter_context(DaemonProcess(
                {"bench": shards}, ("--threads", str(threads), "--max-batch-size", str(batch)), cwd=_REPO))
            if quota is not None:
                quota.add(daemon.pid)
                stack.callback(quota.lift)  # before its daemon stops, which it would do at the quota's pace
            procs.append(daemon)
        yield [d.address for d in procs], procs


def _loader(addresses: list[str], args: argparse.Namespace, return_keys: bool = False,
            pool_stall_timeout_s: float = 1.0, pool: str = "all") -> FeederLoader:
    return FeederLoader("bench", address=addresses, split="train", batch_size=args.batch_size,
                        image_size=args.image_size, seed=args.seed, rank=0, world_size=1, normalize=False,
                        augment="train", return_keys=return_keys, pool_stall_timeout_s=pool_stall_timeout_s, pool=pool)


def _endless(loader: FeederLoader) -> Iterator[tuple]:
    while True:
        yield from loader


def _rates(loader: FeederLoader, args: argparse.Namespace) -> tuple[list[float], float]:
    """Images/s of each window after the warm-up, and the consumer's CPU ms per image."""
    batches = _endless(loader)
    end = time.monotonic() + args.warmup
    while time.monotonic() < end:
        next(batches)
    rates, cpu_before, images_all = [], _cpu_s(), 0
    for _ in range(args.repeats):
        images, start = 0, time.monotonic()
        while time.monotonic() - start < args.seconds:
            images += len(next(batches)[0])
        rates.append(images / (time.monotonic() - start))
        images_all += images
    return rates, 1000 * (_cpu_s() - cpu_before) / max(images_all, 1)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _scale(shards: Path, args: argparse.Namespace) -> list[dict]:
    rows = []
    for count in args.pool:
        with _daemons(shards, count, args.daemon_cpus, args.daemon_threads, args.batch_size) as (addresses, _):
            with _loader(addresses, args) as loader:
                rates, cpu_ms = _rates(loader, args)
                in_use = loader.daemons_in_use
        median = statistics.median(rates)
        rows.append({"daemons": count, "in_use": in_use, "images_per_s": rates, "median_images_per_s": median,
                     "consumer_cpu_ms_per_image": cpu_ms})
        print(f"{count} daemon(s) at {args.daemon_cpus:g} core each: {median:.0f} images/s "
              f"(consumer {cpu_ms:.3f} CPU ms per image)", flush=True)
    one = next((r["median_images_per_s"] for r in rows if r["daemons"] == 1), None)
    for row in rows:
        if one:
            row["speedup"] = row["median_images_per_s"] / one
            row["efficiency"] = row["speedup"] / row["daemons"]
    return rows


def _kill_one(shards: Path, args: argparse.Namespace) -> dict:
    """A pool of 3, one daemon SIGKILLed after a few seconds: the longest wait after
    it, and every sample of the epochs read once."""
    with _daemons(shards, 3, args.daemon_cpus, args.daemon_threads, args.batch_size) as (addresses, procs):
        with _loader(addresses, args, return_keys=True) as loader:
            per_epoch: dict[int, Counter[str]] = {}
            waits, killed_at, started = [], None, time.monotonic()
            for epoch in range(args.kill_epochs):
                loader.set_epoch(epoch)
                batches = iter(loader)
                while True:
                    before = time.monotonic()
                    item = next(batches, None)
                    if item is None:
                        break
                    waits.append((before, time.monotonic() - before))
                    per_epoch.setdefault(epoch, Counter()).update(item[2])
                    if killed_at is None and before - started > args.warmup:
                        os.kill(procs[1].pid, signal.SIGKILL)
                        killed_at = time.monotonic()
            part = loader.samples_per_rank // args.batch_size * args.batch_size
    after = [w for t, w in waits if killed_at is not None and t >= killed_at]
    repeated = sum(max(0, n - 1) for c in per_epoch.values() for n in c.values())
    lost = sum(part - len(c) for c in per_epoch.values())
    result = {"epochs": args.kill_epochs, "longest_wait_after_kill_s": max(after, default=0.0),
              "repeated": repeated, "lost": lost}
    print(f"one of 3 daemons SIGKILLed: longest wait after it {result['longest_wait_after_kill_s']:.2f} s; "
          f"{lost} samples lost, {repeated} repeated over {args.kill_epochs} epochs", flush=True)
    return result


def _as_needed(shards: Path, args: argparse.Namespace, one_daemon: float | None) -> dict:
    """``pool="as-needed"`` over 2 daemons: a consumer that is never the limit for
    ``--as-needed-s``, then one slowed to a quarter of the rate it had, each epoch
    checked whole and the daemons in use at its end recorded."""
    with _daemons(shards, 2, args.daemon_cpus, args.daemon_threads, args.batch_size) as (addresses, _):
        with _loader(addresses, args, return_keys=True, pool="as-needed") as loader:
            part = loader.samples_per_rank // args.batch_size * args.batch_size
            started, grown_s, shrunk_s, slow_from = time.monotonic(), None, None, None
            epochs: list[dict] = []
            images_at_two, two_since, step_s = 0, None, 0.0
            while time.monotonic() - started < 2 * args.as_needed_s:
                seen: Counter[str] = Counter()
                for images, _, keys in loader:
                    seen.update(keys)
                    now = time.monotonic()
                    if grown_s is None and loader.daemons_in_use == 2:
                        grown_s, two_since = now - started, now
                    if two_since is not None and slow_from is None:
                        images_at_two += len(images)
                    if slow_from is None and now - started >= args.as_needed_s and two_since is not None:
                        rate = images_at_two / (now - two_since)
                        slow_from, step_s = now, 4 * args.batch_size / rate  # a quarter of the rate it had
                    if slow_from is not None:
                        time.sleep(step_s)
                        if shrunk_s is None and loader.daemons_in_use == 1:
                            shrunk_s = time.monotonic() - slow_from
                epochs.append({"whole": len(seen) == part and max(seen.values()) == 1,
                               "daemons_in_use_at_end": loader.daemons_in_use,
                               "slowed": slow_from is not None})
    fast, slowed = [e for e in epochs if not e["slowed"]], [e for e in epochs if e["slowed"]]
    first_two = next((e for e in fast if e["daemons_in_use_at_end"] == 2), None)
    first_one = next((e for e in slowed if e["daemons_in_use_at_end"] == 1), None)
    rate = images_at_two / (slow_from - two_since) if slow_from and two_since else 0.0
    result = {"both_in_use_after_s": grown_s, "images_per_s_on_two": rate,
              "speedup_over_one_daemon": rate / one_daemon if one_daemon else None,
              "back_to_one_after_slowing_s": shrunk_s, "epochs": len(epochs),
              "every_epoch_whole": all(e["whole"] for e in epochs),
              "two_in_use_at_every_epoch_end_after_growth_until_slowed": all(
                  e["daemons_in_use_at_end"] == 2 for e in fast[fast.index(first_two):]) if first_two else None,
              "one_in_use_at_every_epoch_end_once_back": all(
                  e["daemons_in_use_at_end"] == 1 for e in slowed[slowed.index(first_one):]) if first_one else None,
              "epoch_ends": epochs}
    print(f"as-needed over 2 daemons: both in use after {grown_s} s, {rate:.0f} images/s "
          f"({result['speedup_over_one_daemon'] or 0:.2f}x one daemon); back to one {shrunk_s} s after the "
          f"consumer slowed to a quarter; every epoch whole: {result['every_epoch_whole']}", flush=True)
    return result


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--pool", default="1,2,4", help="comma list of pool sizes to measure")
    parser.add_argument("--daemon-cpus", type=float, default=0.25, help="CPU quota of each daemon, in cores")
    parser.add_argument("--daemon-threads", type=int, default=1, help="each daemon's --threads")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measured window")
    parser.add_argument("--warmup", type=float, default=3.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--kill", action="store_true", help="also the fault run: one of 3 daemons SIGKILLed")
    parser.add_argument("--kill-epochs", type=int, default=2, help="epochs read in the fault run")
    parser.add_argument("--as-needed", action="store_true", help="also pool='as-needed' over 2 daemons")
    parser.add_argument("--as-needed-s", type=float, default=40.0,
                        help="seconds of the as-needed run at full speed (then as long slowed)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args(argv)
    args.pool = [int(n) for n in args.pool.split(",")]
    if min(args.pool) < 1 or args.daemon_cpus <= 0:
        parser.error("--pool sizes and --daemon-cpus must be positive")
    return args


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shards = args.shards or prepare_sample(args.cache).shards
    report: dict = {"benchmark": "pool", "config": {k: str(v) if isinstance(v, Path) else v
                                                     for k, v in vars(args).items()} | {"shards": str(shards)}}
    report["rows"] = _scale(shards, args)
    if args.kill:
        report["kill"] = _kill_one(shards, args)
    if args.as_needed:
        one = next((r["median_images_per_s"] for r in report["rows"] if r["daemons"] == 1), None)
        report["as_needed"] = _as_needed(shards, args, one)
    if args.json:
        report = write_document(args.json, report)
    return report


if __name__ == "__main__":
    main()
