"""Batches with a few very large images: images/s and the wait for each batch, with
and without the daemon's look-ahead (``feeder serve --lookahead``).

Two copies of the bench's sample data are sharded the same way (without half-scale
copies, ``feeder shard``'s default, or with them: ``--half-copies``): the data as it
is, and the same tree with ``--large-fraction`` of its training images (chosen by the
seed) upscaled to 8-16 MP, as camera photos are (a mild noise
keeps their entropy coding from being trivially cheap). Each configuration (data x
look-ahead) runs a fresh ``feeder serve --threads T`` read by one ``FeederLoader``
(shared memory, 224 px, batch 64, train augmentation), for ``--seconds`` after a
warm-up, in rounds that alternate the configurations.

Reported per configuration (medians over rounds): images/s; the daemon's CPU ms per
image (its process, threads and all); and the median and p99 of the wait for a batch
(the time ``next()`` blocks). Each data's decode cost is measured alone, once a
round: CPU ms per image of the pipeline on one thread, no look-ahead. For the large
data, ``x_scaled`` is its images/s over the plain data's scaled by their decode cost
ratio (plain images/s x plain cost / large cost, at the same look-ahead): how
much of the rate the extra decoding leaves the pipeline keeps (target >= 0.9), and
``p99_x_median`` the wait's spread (target <= 2).

Usage::

    python bench/slow_samples.py --rounds 3 --json bench/results/slow-samples.json
"""

from __future__ import annotations

import argparse
import functools
import io
import os
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

if __package__ in (None, ""):  # run as a script: python bench/slow_samples.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import prepare_sample  # noqa: E402
from bench.loaders.store_peers import built_once  # noqa: E402
from bench.pipeline import _jobs as pipeline_jobs  # noqa: E402
from bench.pipeline import rate  # noqa: E402
from bench.report import write_document  # noqa: E402
from clients import FeederLoader  # noqa: E402
from decode.pipeline import PipelineSpec  # noqa: E402
from decode.runner import PipelineRunner  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402
from sharder import ShardConfig, shard  # noqa: E402
from shards.reader import ShardDataset  # noqa: E402
from transport.base import host_slot  # noqa: E402

__all__ = ["enlarge", "main", "measure", "parse_args"]

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".bench"


def _large(path: Path, rng: np.random.Generator, megapixels: tuple[float, float]) -> bytes:
    """``path``'s photo upscaled to a random area in ``megapixels``, as a JPEG."""
    with Image.open(path) as opened:
        image = opened.convert("RGB")
    area = rng.uniform(*megapixels) * 1e6
    scale = (area / (image.width * image.height)) ** 0.5
    big = image.resize((round(image.width * scale), round(image.height * scale)), Image.Resampling.BICUBIC)
    pixels = np.asarray(big, dtype=np.int16)
    noisy = np.clip(pixels + rng.normal(0, 3, pixels.shape), 0, 255).astype(np.uint8)
    out = io.BytesIO()
    Image.fromarray(noisy).save(out, format="JPEG", quality=90)
    return out.getvalue()


def enlarge(src: Path, out: Path, fraction: float, megapixels: tuple[float, float], seed: int) -> int:
    """A copy of the tree ``src`` at ``out`` (files hard-linked) with ``fraction`` of
    its ``train`` JPEGs replaced by large ones; how many were."""
    rng = np.random.default_rng(seed)
    train = sorted(p for p in (src / "train").rglob("*") if p.is_file())
    chosen = {train[i] for i in rng.choice(len(train), size=max(1, round(fraction * len(train))), replace=False)}
    for path in sorted(p for p in src.rglob("*") if p.is_file()):
        target = out / path.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        if path in chosen:
            target.write_bytes(_large(path, rng, megapixels))
        else:
            os.link(path, target)
    return len(chosen)


def _datasets(args: argparse.Namespace) -> dict[str, Path]:
    """The sample shards, and those of the tree with large images (made once), both
    with half-scale copies or both without (``args.half_copies``)."""
    plain = prepare_sample(args.cache, args.seed)
    source = plain.source
    if source is None:
        raise SystemExit("slow_samples: the sample data has no source tree")
    lo, hi = args.large_mp
    root = args.cache / f"slow-{args.large_fraction:g}-{lo:g}-{hi:g}-{args.seed}"
    root.mkdir(parents=True, exist_ok=True)
    built_once(root / "src", lambda tmp: enlarge(source, tmp, args.large_fraction, (lo, hi), args.seed))
    made = {}
    copies = "half-copies" if args.half_copies else "no-copies"
    for name, src in (("plain", source), ("large", root / "src")):
        if name == "plain" and args.half_copies:
            made[name] = plain.shards  # the bench's own sample shards: the same options
            continue
        shards = root / f"{name}-{copies}"
        config = ShardConfig(src, shards, seed=args.seed, half_copies=args.half_copies, progress=True)
        built_once(shards, functools.partial(_shard_into, config))
        made[name] = shards
    return made


def _shard_into(config: ShardConfig, out: Path) -> None:
    shard(replace(config, out=out))


def decode_cost_ms(shards: Path, args: argparse.Namespace) -> float:
    """CPU ms per image of the pipeline alone on one thread (no look-ahead) over the
    daemon's train batches of ``shards``: what the data costs to decode."""
    split = ShardDataset.open("bench", shards).splits["train"]
    runner = PipelineRunner(PipelineSpec(max_batch_size=args.batch_size, threads=1, prefetch=1))
    runner.lookahead = 0
    try:
        plan = argparse.Namespace(seed=args.seed, batch_size=args.batch_size, image_size=args.image_size)
        return rate(runner.run_many(pipeline_jobs(split, plan), host_slot), 1.0, args.cost_seconds)[1]
    finally:
        runner.close()


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _endless(loader: FeederLoader):  # type: ignore[no-untyped-def]
    while True:  # each pass over the loader is the rest of one epoch
        yield from loader


def _run(shards: Path, lookahead: int, args: argparse.Namespace) -> dict:
    """One fresh daemon and loader: its figures."""
    options = ("--device", "cpu", "--threads", str(args.threads), "--lookahead", str(lookahead),
               "--max-batch-size", str(args.batch_size))
    with DaemonProcess({"bench": shards}, options) as daemon:
        loader = FeederLoader("bench", address=daemon.address, split="train", batch_size=args.batch_size,
                              image_size=args.image_size, seed=args.seed, normalize=False, augment="train",
                              transport="shm")
        with loader:
            batches = _endless(loader)
            warm_until = time.perf_counter() + args.warmup
            while time.perf_counter() < warm_until:
                next(batches)
            images, waits = 0, []
            cpu_before = _cpu_s(daemon.pid)
            started = time.perf_counter()
            while time.perf_counter() - started < args.seconds:
                asked = time.perf_counter()
                batch, _ = next(batches)
                waits.append(time.perf_counter() - asked)
                images += len(batch)
            seconds = time.perf_counter() - started
            cpu = _cpu_s(daemon.pid) - cpu_before
    waits.sort()
    median, p99 = statistics.median(waits), waits[int(0.99 * (len(waits) - 1))]
    return {"images_per_s": round(images / seconds, 1), "batches": len(waits),
            "daemon_cpu_ms_per_image": round(1000 * cpu / images, 3),
            "wait_median_ms": round(1000 * median, 2), "wait_p99_ms": round(1000 * p99, 2),
            "p99_x_median": round(p99 / median, 2)}


def _summary(runs: dict[tuple[str, int], list[dict]], costs: dict[str, list[float]]) -> list[dict]:
    """Medians over rounds per configuration, and the large data's scaled ratio."""
    rows: dict[tuple[str, int], dict[str, Any]] = {}
    cost = {data: statistics.median(values) for data, values in costs.items()}
    for (data, lookahead), results in runs.items():
        row = {"data": data, "lookahead": lookahead, "rounds": len(results),
               "decode_cpu_ms_per_image": round(cost[data], 3)}
        for name in ("images_per_s", "daemon_cpu_ms_per_image", "wait_median_ms", "wait_p99_ms", "p99_x_median"):
            row[name] = round(statistics.median(r[name] for r in results), 3)
        rows[data, lookahead] = row
    for (data, lookahead), row in rows.items():
        plain = rows.get(("plain", lookahead))
        if data == "large" and plain is not None:
            scaled = plain["images_per_s"] * cost["plain"] / cost["large"]
            row["scaled_images_per_s"] = round(scaled, 1)
            row["x_scaled"] = round(row["images_per_s"] / scaled, 3)
            row["x_plain"] = round(row["images_per_s"] / plain["images_per_s"], 3)
    return list(rows.values())


def measure(args: argparse.Namespace) -> dict:
    """Every configuration, ``args.rounds`` times, alternating; each data's decode
    cost once per round."""
    datasets = _datasets(args)
    runs: dict[tuple[str, int], list[dict]] = {}
    costs: dict[str, list[float]] = {}
    for r in range(args.rounds):
        for data, shards in datasets.items():
            costs.setdefault(data, []).append(decode_cost_ms(shards, args))
            print(f"slow_samples: round {r + 1} {data}: decoding {costs[data][-1]:.3f} CPU ms per image", flush=True)
            for lookahead in args.lookaheads:
                result = _run(shards, lookahead, args)
                runs.setdefault((data, lookahead), []).append(result)
                print(f"slow_samples: round {r + 1} {data} lookahead {lookahead}: {result}", flush=True)
    return {"rows": _summary(runs, costs), "decode_cpu_ms_per_image": costs,
            "runs": [{"data": d, "lookahead": k, "results": v} for (d, k), v in runs.items()]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the data is made once")
    p.add_argument("--large-fraction", type=float, default=0.02, help="share of training images made large")
    p.add_argument("--large-mp", type=lambda s: tuple(float(v) for v in s.split(",")), default=(8.0, 16.0),
                   help="range of the large images' areas, in megapixels (LO,HI)")
    p.add_argument("--lookaheads", type=lambda s: [int(v) for v in s.split(",")], default=[0, 4],
                   help="feeder serve --lookahead values to compare")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="feeder serve --threads")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224)
    p.add_argument("--half-copies", action=argparse.BooleanOptionalAction, default=False,
                   help="shard both with half-scale copies (as the bench's sample data) or without (the default)")
    p.add_argument("--seconds", type=float, default=10.0, help="measured seconds per run")
    p.add_argument("--cost-seconds", type=float, default=4.0, help="seconds of the pipeline alone per decode cost")
    p.add_argument("--warmup", type=float, default=3.0)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results here")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    document = measure(args)
    for row in document["rows"]:
        print(row)
    if args.json:
        config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "json"}
        write_document(args.json, {"bench": "slow_samples", "command": sys.argv, "config": config, **document})


if __name__ == "__main__":
    main()
