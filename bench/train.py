"""What the input path costs the trainer: images/s of ``python -m trainer.train`` fed
by a feeder daemon beside the same trainer on ``--data synthetic`` (random tensors
made on the device, the upper bound), plus the sample data's time to a target top-1.

The daemon runs as its own process (``feeder serve --port 0``), the trainer under
torchrun with ``--nproc`` ranks (gloo on CPU, NCCL on GPUs). Feeder and synthetic runs
alternate, repeat after repeat, so machine noise hits both; each run's first epoch is
a warm-up and left out; medians and their ratio are reported.

Example::

    python bench/train.py --json bench/results/train.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import prepare_sample, resolve  # noqa: E402
from bench.report import write_json  # noqa: E402
from feeder.launcher import DaemonProcess  # noqa: E402

__all__ = ["main", "parse_args"]

_REPO = Path(__file__).resolve().parent.parent
_SCHEDULE = """
label_smoothing = 0.1
[[phases]]
epochs = {epochs}
image_size = {image_size}
batch_size = {batch_size}
lr_start = 0.05
lr_end = 0.05
momentum = 0.9
"""


def _train(address: str, out: Path, args: argparse.Namespace, *options: str) -> dict:
    """One torchrun trainer run; returns its summary.json."""
    env = dict(os.environ, PYTHONPATH=str(_REPO))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // args.nproc)))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), "-m", "trainer.train",
               "--server", address, "--dataset", "bench", "--arch", args.arch,
               "--out-dir", str(out), "--log-every-steps", "0", "--seed", str(args.seed),
               *options]
    result = subprocess.run(command, cwd=_REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    print(result.stdout.strip().splitlines()[-1], flush=True)
    return json.loads((out / "summary.json").read_text())


def _speed(summary: dict) -> tuple[float, float]:
    """Median images/s and stall fraction over the epochs after the first."""
    measured = summary["records"][1:] or summary["records"]
    return (statistics.median(r["images_per_s"] for r in measured),
            statistics.median(r["stall_fraction"] for r in measured))


def _throughput(address: str, work: Path, args: argparse.Namespace) -> dict:
    schedule = work / "bench.toml"
    schedule.write_text(_SCHEDULE.format(epochs=args.epochs, image_size=args.image_size,
                                         batch_size=args.batch_size))
    common = ["--schedule", str(schedule), "--val-every-epochs", "0",
              "--max-steps-per-epoch", str(args.steps_per_epoch)]
    runs: dict[str, list[tuple[float, float]]] = {"feeder": [], "synthetic": []}
    for repeat in range(args.repeats):
        for data in ("feeder", "synthetic"):
            out = work / f"{data}-{repeat}"
            runs[data].append(_speed(_train(address, out, args, *common, "--data", data)))
    feeder = statistics.median(s for s, _ in runs["feeder"])
    synthetic = statistics.median(s for s, _ in runs["synthetic"])
    return {
        "feeder_images_per_s": feeder,
        "synthetic_images_per_s": synthetic,
        "feeder_over_synthetic": feeder / synthetic if synthetic else None,
        "feeder_stall_fraction": statistics.median(f for _, f in runs["feeder"]),
        "runs": runs,
    }


def _time_to_accuracy(address: str, work: Path, args: argparse.Namespace) -> dict:
    summary = _train(address, work / "tta", args, "--schedule", args.schedule,
                     "--target-top1", str(args.target_top1))
    return {
        "target_top1": args.target_top1,
        "time_to_target_s": summary["time_to_target_s"],
        "epochs": summary["epochs"],
        "val_top1": summary["val_top1"],
        "val_images": summary["val_images"],
        "images_per_s": summary["images_per_s"],
        "stall_fraction": summary["stall_fraction"],
    }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (torchrun)")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--image-size", type=int, default=64, help="training side, px")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--epochs", type=int, default=3, help="per throughput run; the first is warm-up")
    parser.add_argument("--steps-per-epoch", type=int, default=15)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2, help="daemon DALI CPU threads")
    parser.add_argument("--schedule", default="sample", help="schedule of the time-to-accuracy run")
    parser.add_argument("--target-top1", type=float, default=80.0, help="percent")
    parser.add_argument("--skip-accuracy", action="store_true", help="throughput only")
    parser.add_argument("--skip-throughput", action="store_true", help="time to accuracy only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoded-cache-bytes", default="0",
                        help="the daemon's decoded cache budget (feeder serve --decoded-cache-bytes, e.g. 2G; 0: off)")
    parser.add_argument("--decoded-cache-side", type=int, default=256, help="feeder serve --decoded-cache-side, px")
    parser.add_argument("--json", type=Path, help="write results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; prints the figures and returns them."""
    args = parse_args(argv)
    data = resolve(args.shards, None) if args.shards else prepare_sample(args.cache, args.seed)
    options = ("--device", "cpu", "--threads", str(args.threads),
               "--decoded-cache-bytes", args.decoded_cache_bytes, "--decoded-cache-side", str(args.decoded_cache_side))
    with DaemonProcess({"bench": data.shards}, options, cwd=_REPO) as daemon:
        address = daemon.address
        with tempfile.TemporaryDirectory(prefix="feeder-bench-train-") as tmp:
            results: dict = {}
            if not args.skip_throughput:
                results["throughput"] = _throughput(address, Path(tmp), args)
            if not args.skip_accuracy:
                results["accuracy"] = _time_to_accuracy(address, Path(tmp), args)
    if "throughput" in results:
        speed = results["throughput"]
        print(f"trainer images/s: feeder {speed['feeder_images_per_s']:.1f}, synthetic "
              f"{speed['synthetic_images_per_s']:.1f} "
              f"(ratio {speed['feeder_over_synthetic']:.2f}), "
              f"stall {speed['feeder_stall_fraction']:.1%}")
    if "accuracy" in results:
        acc = results["accuracy"]
        reached = acc["time_to_target_s"]
        when = f"{reached:.1f} s" if reached is not None else "not reached"
        print(f"time to {acc['target_top1']:.0f}% top-1: {when} "
              f"({acc['epochs']} epochs, final top-1 {acc['val_top1']:.1%})")
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json(args.json, config, [results], sys.argv)
    return results


if __name__ == "__main__":
    main()
