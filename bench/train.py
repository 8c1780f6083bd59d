"""What the input path costs the trainer: ``python -m trainer.train`` fed by a feeder
daemon beside the same trainer on ``--data synthetic`` (random tensors made on the
device: the upper bound), at each image size of a schedule, plus the sample data's
time to a target top-1.

One daemon (``feeder serve --port 0``, on the GPU where there is CUDA) serves
``--nproc`` trainer ranks under torchrun (NCCL on GPUs, gloo on CPUs), as on a
training node. A run trains a phase of ``--epochs-per-size`` whole epochs at each
``--sizes`` (validating as configured); feeder and synthetic runs alternate, repeat
after repeat, so machine noise hits both. ``--variant`` compares several daemons
(GPU decode with the tuned CPU share, GPU only, CPU only) against the same synthetic
runs. Each phase's first epoch is a warm-up
(streams opening, cuDNN choosing its kernels) and left out; per size the medians are
reported: images/s per rank and its ratio to synthetic, the device's idle share
between steps fed and synthetic and their difference (the stall as the GPU sees it),
the host's wait for data, and the transport that carried the batches. From the
per-size rates it prints the projected time of ``imagenet-fastai`` on 8 GPUs
(:mod:`bench.train_projection`).

Example (a GPU node)::

    python bench/train.py --arch resnet50 --sizes 128,224 --batch-size 256 --nproc 1 \\
        --images-per-class 800 --skip-accuracy --json bench/results/train-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import SAMPLE_TRAIN_PER_CLASS, prepare_sample, resolve  # noqa: E402
from bench.report import write_json  # noqa: E402
from bench.train_projection import project  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402

__all__ = ["main", "parse_args", "phase_figures", "trainer_env"]

_REPO = Path(__file__).resolve().parent.parent
_DATA = ("feeder", "synthetic")


def trainer_env(nproc: int) -> dict[str, str]:
    """This environment for a trainer child: the repository first on ``PYTHONPATH``,
    what was there kept after it (a GPU machine's carried packages), and each rank
    a share of the CPUs for its own threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _schedule(sizes: list[int], epochs: int, batch_size: int) -> str:
    phase = ("[[phases]]\nepochs = {epochs}\nimage_size = {size}\nbatch_size = {batch}\n"
             "lr_start = 0.05\nlr_end = 0.05\nmomentum = 0.9\n")
    return "label_smoothing = 0.1\n" + "".join(phase.format(epochs=epochs, size=s, batch=batch_size) for s in sizes)


def _train(address: str, out: Path, args: argparse.Namespace, *options: str) -> dict:
    """One torchrun trainer run; returns its summary.json."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               "--nproc-per-node", str(args.nproc), "-m", "trainer.train",
               "--server", address, "--dataset", "bench", "--arch", args.arch,
               "--out-dir", str(out), "--log-every-steps", "0", "--seed", str(args.seed),
               "--prefetch-batches", str(args.prefetch_batches), *options]
    env = trainer_env(args.nproc) | {"TMPDIR": str(out.parent)}  # torchrun's files go with the bench's folder
    result = subprocess.run(command, cwd=_REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    print(result.stdout.strip().splitlines()[-1], flush=True)
    return json.loads((out / "summary.json").read_text())


def phase_figures(summary: dict, nproc: int) -> dict[int, dict[str, float]]:
    """Per image size: the medians over its epochs past the first (the warm-up) of
    images/s per rank, the device's idle share and the host's stall share."""
    by_size: dict[int, list[dict]] = {}
    for record in summary["records"]:
        by_size.setdefault(int(record["image_size"]), []).append(record)
    figures = {}
    for size, records in by_size.items():
        measured = records[1:] or records
        figures[size] = {
            "images_per_s": statistics.median(r["images_per_s"] for r in measured) / nproc,
            "idle_fraction": statistics.median(r.get("idle_fraction", 0.0) for r in measured),
            "stall_fraction": statistics.median(r["stall_fraction"] for r in measured),
        }
    return figures


def _medians(runs: list[dict[int, dict[str, float]]], size: int) -> dict[str, float]:
    return {key: statistics.median(run[size][key] for run in runs) for key in runs[0][size]}


def _throughput(addresses: dict[str, str], work: Path, args: argparse.Namespace) -> dict:
    """Per repeat, a fed run per daemon variant and a synthetic run, the order turned
    around each repeat; per variant and size, the medians against synthetic."""
    schedule = work / "bench.toml"
    schedule.write_text(_schedule(args.sizes, args.epochs_per_size, args.batch_size))
    common = ["--schedule", str(schedule), "--val-every-epochs", str(args.val_every_epochs)]
    runs: dict[str, list[dict[int, dict[str, float]]]] = {name: [] for name in [*addresses, "synthetic"]}
    transports: dict[str, set[str]] = {name: set() for name in addresses}
    order = [*addresses, "synthetic"]
    for repeat in range(args.repeats):
        for name in (order if repeat % 2 == 0 else order[::-1]):
            data = "synthetic" if name == "synthetic" else "feeder"
            address = addresses.get(name) or next(iter(addresses.values()))  # synthetic: the dataset's size
            summary = _train(address, work / f"{name}-{repeat}", args, *common, "--data", data)
            runs[name].append(phase_figures(summary, args.nproc))
            if name in transports:
                transports[name].add(summary.get("transport", ""))
    synthetic = {size: _medians(runs["synthetic"], size) for size in args.sizes}
    variants = {}
    for name in addresses:
        sizes = {}
        for size in args.sizes:
            fed = _medians(runs[name], size)
            sizes[str(size)] = {
                "feeder_images_per_s": fed["images_per_s"],
                "synthetic_images_per_s": synthetic[size]["images_per_s"],
                "feeder_over_synthetic": fed["images_per_s"] / synthetic[size]["images_per_s"],
                "feeder_idle_fraction": fed["idle_fraction"],
                "synthetic_idle_fraction": synthetic[size]["idle_fraction"],
                "idle_fed_minus_synthetic": fed["idle_fraction"] - synthetic[size]["idle_fraction"],
                "feeder_stall_fraction": fed["stall_fraction"],
            }
        projection = project({int(size): f["feeder_images_per_s"] for size, f in sizes.items()}, gpus=8)
        variants[name] = {"sizes": sizes, "transport": ",".join(sorted(transports[name])),
                          "projected_minutes": projection.minutes, "projection": projection.line()}
    return {"variants": variants,
            "synthetic_projected_minutes": project(
                {size: figures["images_per_s"] for size, figures in synthetic.items()}, gpus=8).minutes,
            "runs": {name: [{str(k): v for k, v in run.items()} for run in per] for name, per in runs.items()}}


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
        "idle_fraction": summary.get("idle_fraction", 0.0),
    }


def _sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct positive sides, e.g. 128,224")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--images-per-class", type=int, default=SAMPLE_TRAIN_PER_CLASS,
                        help="without --shards: training images per class of the sample (10 classes)")
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (torchrun), sharing one daemon")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--sizes", type=_sizes, default=[64], help="training sides, px, one phase each (e.g. 128,224)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--epochs-per-size", type=int, default=3, help="whole epochs a phase; the first is warm-up")
    parser.add_argument("--val-every-epochs", type=int, default=1, help="validate as users do (0: never)")
    parser.add_argument("--repeats", type=int, default=3, help="feeder and synthetic runs each, interleaved")
    parser.add_argument("--prefetch-batches", type=int, default=4, help="the loader's ready batches per rank")
    parser.add_argument("--daemon-device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="where the daemon decodes (auto: the GPU where there is CUDA)")
    parser.add_argument("--threads", type=int, default=0, help="daemon CPU threads (0: it tunes them)")
    parser.add_argument("--ring-slots", type=int, default=0, help="daemon ring slots per stream (0: sized per stream)")
    parser.add_argument("--serve-args", default="", help="more feeder serve options, e.g. '--cpu-decode-share 0'")
    parser.add_argument("--variant", type=_variant, action="append", default=[],
                        help="a daemon to compare, NAME='SERVE-OPTIONS' (repeatable; each fed run against the same "
                             "synthetic runs), e.g. cpu='--device cpu --threads 12'")
    parser.add_argument("--schedule", default="sample", help="schedule of the time-to-accuracy run")
    parser.add_argument("--target-top1", type=float, default=80.0, help="percent")
    parser.add_argument("--skip-accuracy", action="store_true", help="throughput only")
    parser.add_argument("--skip-throughput", action="store_true", help="time to accuracy only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoded-cache-bytes", default="0",
                        help="the daemon's decoded cache budget (feeder serve --decoded-cache-bytes, e.g. 2G; 0: off)")
    parser.add_argument("--decoded-cache-side", type=int, default=256, help="feeder serve --decoded-cache-side, px")
    parser.add_argument("--json", type=Path, help="write results here")
    args = parser.parse_args(argv)
    for name in ("nproc", "batch_size", "epochs_per_size", "repeats", "prefetch_batches", "images_per_class"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    return args


def _variants(args: argparse.Namespace) -> dict[str, tuple[str, ...]]:
    """Each daemon variant's ``feeder serve`` options: ``--variant NAME=OPTIONS`` as
    given (after the common ones, so they win), else one, ``feeder``, from
    ``--daemon-device`` and ``--serve-args``."""
    device = args.daemon_device
    if device == "auto":
        import torch

        device = "gpu" if torch.cuda.is_available() else "cpu"
    common = ("--device", device, "--threads", str(args.threads), "--ring-slots", str(args.ring_slots),
              "--decoded-cache-bytes", args.decoded_cache_bytes, "--decoded-cache-side", str(args.decoded_cache_side))
    if not args.variant:
        return {"feeder": (*common, *shlex.split(args.serve_args))}
    return {name: (*common, *shlex.split(options)) for name, options in args.variant}


def _variant(text: str) -> tuple[str, str]:
    name, sep, options = text.partition("=")
    if not sep or not name.strip() or name.strip() == "synthetic":
        raise argparse.ArgumentTypeError(f"{text!r}: NAME=SERVE-OPTIONS, e.g. gpu-only='--cpu-decode-share 0'")
    return name.strip(), options


def _report(results: dict) -> None:
    if "throughput" in results:
        speed = results["throughput"]
        for name, variant in speed["variants"].items():
            for size, s in variant["sizes"].items():
                print(f"{name}, {size} px: {s['feeder_images_per_s']:,.0f} img/s per rank, synthetic "
                      f"{s['synthetic_images_per_s']:,.0f} ({s['feeder_over_synthetic']:.3f}x); device idle "
                      f"{s['feeder_idle_fraction']:.1%} fed, {s['synthetic_idle_fraction']:.1%} synthetic "
                      f"({s['idle_fed_minus_synthetic']:+.1%}); host stall {s['feeder_stall_fraction']:.1%}; "
                      f"over {variant['transport'] or '?'}")
            print(f"{name}: {variant['projection']}")
        print(f"synthetic: projected {speed['synthetic_projected_minutes']:.1f} min")
    if "accuracy" in results:
        acc = results["accuracy"]
        reached = acc["time_to_target_s"]
        when = f"{reached:.1f} s" if reached is not None else "not reached"
        print(f"time to {acc['target_top1']:.0f}% top-1: {when} "
              f"({acc['epochs']} epochs, final top-1 {acc['val_top1']:.1%})")


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; prints the figures and returns them."""
    args = parse_args(argv)
    if args.shards:
        data = resolve(args.shards, None)
    else:
        data = prepare_sample(args.cache, args.seed, train_per_class=args.images_per_class)
    with ExitStack() as daemons, tempfile.TemporaryDirectory(prefix="feeder-bench-train-") as tmp:
        addresses = {name: daemons.enter_context(DaemonProcess({"bench": data.shards}, options, cwd=_REPO)).address
                     for name, options in _variants(args).items()}
        results: dict = {}
        if not args.skip_throughput:
            results["throughput"] = _throughput(addresses, Path(tmp), args)
        if not args.skip_accuracy:
            results["accuracy"] = _time_to_accuracy(next(iter(addresses.values())), Path(tmp), args)
    _report(results)
    if args.json:
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        write_json(args.json, config, [results], sys.argv)
    return results


if __name__ == "__main__":
    main()
