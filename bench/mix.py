"""Images/s of a mixed stream against a plain one over the same images, one run.

One ``feeder serve`` serves the same shard directory under two names, ``a`` and
``b``. The plain stream reads ``a``; the mixed one reads ``{a: W, b: 1 - W}`` with an
epoch of the same length: the same JPEGs, decoded and augmented the same way, the
mix's own work (its plan, the composite split's reads from two splits, the union's
labels, ``NAME/key`` keys) on top. Each round measures both, in alternating order
(ABBA...), each with a loader of its own over shared memory from its first batch
(setup and the pipeline's first run left out) to the end of ``--epochs`` epochs; the
medians of the rounds are compared (and the median of the rounds' own ratios given
beside), with the daemon's CPU seconds per image. The result goes to ``--json`` with
the revision and the machine.

Example::

    python bench/mix.py --rounds 5 --json bench/results/mix.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import prepare_sample  # noqa: E402
from bench.proctree import cpu_seconds  # noqa: E402
from bench.report import write_document  # noqa: E402
from bench.watched import REPO  # noqa: E402
from clients import FeederLoader  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402

__all__ = ["main", "measure"]

TARGET = 0.97  # the mixed stream's images/s over the plain one's


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache", type=Path, default=REPO / ".bench", help="where the sample data is made once")
    p.add_argument("--rounds", type=int, default=5, help="rounds, each measuring both streams")
    p.add_argument("--epochs", type=int, default=3, help="epochs a measurement reads")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--threads", type=int, default=2, help="the daemon's decode threads")
    p.add_argument("--weight", type=float, default=0.75, help="the mix's weight of a (b gets the rest)")
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    return p.parse_args(argv)


def measure(address: str, dataset: str | dict[str, float], epoch_samples: int | None, args: argparse.Namespace,
            daemon_pid: int) -> dict[str, Any]:
    """One stream's images/s over ``args.epochs`` epochs, from its first batch on, and
    the daemon's CPU seconds per image meanwhile."""
    with FeederLoader(dataset, address=address, batch_size=args.batch_size, image_size=args.image_size, seed=1, rank=0,
                      world_size=1, normalize=False, transport="shm", epoch_samples=epoch_samples) as loader:
        batches = iter(loader)
        next(batches)  # the pipeline's first run: setup, not rate
        images, started, cpu = 0, time.perf_counter(), cpu_seconds(daemon_pid)
        for epoch in range(args.epochs):
            if epoch:
                loader.set_epoch(epoch)
                batches = iter(loader)
            for batch_images, _ in batches:
                images += len(batch_images)
        seconds, cpu = time.perf_counter() - started, cpu_seconds(daemon_pid) - cpu
    return {"images": images, "seconds": round(seconds, 3), "images_per_s": round(images / seconds, 1),
            "daemon_cpu_ms_per_image": round(1000 * cpu / images, 4)}


def _rounds(address: str, size: int, args: argparse.Namespace, pid: int) -> list[dict[str, Any]]:
    mix = {"a": args.weight, "b": 1 - args.weight}
    streams: dict[str, tuple[str | dict[str, float], int | None]] = {"single": ("a", None), "mixed": (mix, size)}
    rounds = []
    for number in range(args.rounds):
        order = ["single", "mixed"] if number % 2 == 0 else ["mixed", "single"]
        found = {name: measure(address, *streams[name], args, pid) for name in order}
        found["ratio"] = round(found["mixed"]["images_per_s"] / found["single"]["images_per_s"], 4)
        print(f"round {number + 1}: single {found['single']['images_per_s']:.0f} images/s, mixed "
              f"{found['mixed']['images_per_s']:.0f} images/s, {found['ratio']:.3f}x", flush=True)
        rounds.append(found | {"order": order})
    return rounds


def _summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    single = statistics.median(r["single"]["images_per_s"] for r in rounds)
    mixed = statistics.median(r["mixed"]["images_per_s"] for r in rounds)
    cpu = {name: statistics.median(r[name]["daemon_cpu_ms_per_image"] for r in rounds) for name in ("single", "mixed")}
    return {"single_images_per_s": single, "mixed_images_per_s": mixed, "ratio": round(mixed / single, 4),
            "ratio_by_round": [r["ratio"] for r in rounds],
            "median_ratio_of_rounds": statistics.median(r["ratio"] for r in rounds), "daemon_cpu_ms_per_image": cpu,
            "target": TARGET, "met": mixed / single >= TARGET}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    data = prepare_sample(args.cache)
    with DaemonProcess({"a": data.shards, "b": data.shards}, ("--threads", str(args.threads))) as daemon:
        with FeederLoader("a", address=daemon.address, rank=0, world_size=1) as probe:
            size = probe.num_samples
        rounds = _rounds(daemon.address, size, args, daemon.pid)
    summary = _summary(rounds)
    print(f"mixed {summary['mixed_images_per_s']:.0f} images/s against single {summary['single_images_per_s']:.0f}: "
          f"{summary['ratio']:.3f}x (target {TARGET}x {'met' if summary['met'] else 'NOT met'})", flush=True)
    if args.json is not None:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"epoch_samples": size}
        write_document(args.json, {"command": sys.argv, "config": config, "rounds": rounds, "summary": summary})
    return 0


if __name__ == "__main__":
    sys.exit(main())
