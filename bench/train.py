"""What the input path costs the trainer: the bundled trainer's step fed by a feeder
daemon beside the same step on synthetic data (random tensors made on the device:
the upper bound), at each image size, plus the sample data's time to a target top-1.

The daemons (``feeder serve --port 0``, on the GPU where there is CUDA; one per
``--variant``, started side by side) serve ``--nproc`` trainer ranks under torchrun
(NCCL on GPUs, gloo on CPUs), as on a training node. Each rank runs
:mod:`bench.train_steady`: one model and optimiser, fed in turn by every daemon and
by synthetic data, over steady windows: per size, ``--warmup-steps`` untimed steps
from each source first (the split decoder tunes its CPU share in them), then
``--repeats`` rounds in which each source runs ``--settle-steps`` and a timed window
of ``--window-steps`` (scaled by pixel count at smaller sizes), the order turned
around each round so that machine drift falls on every source. No validation or
checkpoint runs inside a window, and a daemon's stream is dropped after each of its
windows, so what it made ahead while the others ran is never counted.

Per daemon and size it reports the trainer's step time fed and synthetic and their
ratio (the headline, with the spread of the rounds' ratios), the device's idle share
between steps fed and synthetic, the host's wait for batches, the GPU's utilisation
and its hardware JPEG engines' (NVML, during the windows: 0 % means the engines were
not used), and the transport; and, from the per-size rates, the projected 8-GPU
``imagenet-fastai`` time (:mod:`bench.train_projection`), labelled as what it is: one
GPU with all of this machine's cores, times 8. The JSON is written after every
window (``--json``), so a run cut short keeps what finished.

Example (a GPU node)::

    python bench/train.py --arch resnet50 --sizes 224,128 --batch-size 256 --nproc 1 \\
        --images-per-class 800 --skip-accuracy --json bench/results/train-gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from dataclasses import asdict
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.cpu_quota import CpuQuota  # noqa: E402
from bench.data import SAMPLE_TRAIN_PER_CLASS, prepare_sample, resolve  # noqa: E402
from bench.report import write_document  # noqa: E402
from bench.train_plan import SteadyPlan  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402

__all__ = ["main", "parse_args", "trainer_env"]

_REPO = Path(__file__).resolve().parent.parent


def trainer_env(nproc: int) -> dict[str, str]:
    """This environment for a trainer child: the repository first on ``PYTHONPATH``,
    what was there kept after it (a GPU machine's carried packages), and each rank
    a share of the CPUs for its own threads."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    return env


def _schedule(size: int, batch_size: int) -> str:
    """One phase: the batch size and learning rate the steps run at."""
    return (f"label_smoothing = 0.1\n[[phases]]\nepochs = 1\nimage_size = {size}\nbatch_size = {batch_size}\n"
            "lr_start = 0.05\nlr_end = 0.05\nmomentum = 0.9\n")


def _ranks(args: argparse.Namespace, work: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``command`` (``-m MODULE ...``) on ``--nproc`` ranks: under torchrun, or as one
    plain process for one rank (a launcher less to start)."""
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(args.nproc)]
    run = [sys.executable, *(launcher if args.nproc > 1 else []), *command]
    env = trainer_env(args.nproc) | {"TMPDIR": str(work)}  # torchrun's files go with the bench's folder
    return subprocess.run(run, cwd=_REPO, env=env, capture_output=True, text=True)


def _steady(addresses: dict[str, str], work: Path, json_path: Path, document: dict,
            args: argparse.Namespace) -> dict:
    """The steady windows of every source (bench.train_steady under torchrun); their figures."""
    schedule = work / "steady.toml"
    schedule.write_text(_schedule(args.sizes[0], args.batch_size))
    plan = SteadyPlan(sources=addresses, dataset="bench", schedule=str(schedule), arch=args.arch, sizes=args.sizes,
                      batch_size=args.batch_size, repeats=args.repeats, window_steps=args.window_steps,
                      settle_steps=args.settle_steps, warmup_steps=args.warmup_steps, pause_s=args.pause_s,
                      prefetch_batches=args.prefetch_batches, seed=args.seed, out_dir=str(work / "steady"),
                      json=str(json_path), document=document, cores=os.cpu_count() or 1)
    (work / "plan.json").write_text(json.dumps(asdict(plan)))
    result = _ranks(args, work, "-m", "bench.train_steady", "--plan", str(work / "plan.json"))
    if result.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    return json.loads(json_path.read_text())["results"][0]["throughput"]


def _time_to_accuracy(address: str, work: Path, args: argparse.Namespace) -> dict:
    out = work / "tta"
    result = _ranks(args, work, "-m", "trainer.train", "--server", address, "--dataset", "bench", "--arch",
                       args.arch, "--out-dir", str(out), "--log-every-steps", "0", "--seed", str(args.seed),
                       "--prefetch-batches", str(args.prefetch_batches), "--schedule", args.schedule,
                       "--target-top1", str(args.target_top1))
    if result.returncode != 0:
        raise RuntimeError(f"trainer failed:\n{result.stdout[-2000:]}\n{result.stderr[-4000:]}")
    summary = json.loads((out / "summary.json").read_text())
    return {key: summary.get(key, 0.0) for key in ("time_to_target_s", "epochs", "val_top1", "val_images",
                                                     "images_per_s", "stall_fraction", "idle_fraction")} | {
        "target_top1": args.target_top1}


def _sizes(text: str) -> list[int]:
    sizes = [int(s) for s in text.split(",") if s.strip()]
    if not sizes or min(sizes) < 1 or len(set(sizes)) != len(sizes):
        raise argparse.ArgumentTypeError(f"{text!r}: distinct positive sides, e.g. 224,128")
    return sizes


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--images-per-class", type=int, default=SAMPLE_TRAIN_PER_CLASS,
                        help="without --shards: training images per class of the sample (10 classes)")
    parser.add_argument("--nproc", type=int, default=2, help="trainer ranks (torchrun), sharing the daemons")
    parser.add_argument("--arch", default="resnet18")
    parser.add_argument("--sizes", type=_sizes, default=[64], help="training sides, px, in order (e.g. 224,128)")
    parser.add_argument("--batch-size", type=int, default=16, help="per rank")
    parser.add_argument("--window-steps", type=int, default=20, help="steps a timed window takes at the largest size")
    parser.add_argument("--settle-steps", type=int, default=8,
                        help="untimed steps before each window at the largest size (a new stream's first batches)")
    parser.add_argument("--warmup-steps", type=int, default=64,
                        help="untimed steps of each daemon at each size before its first window (the split "
                             "decoder's CPU share moves 1/64 a batch)")
    parser.add_argument("--repeats", type=int, default=3, help="timed windows per source and size, interleaved")
    parser.add_argument("--pause-s", type=float, default=0.0,
                        help="seconds the trainer stands idle before each window (as validation or a checkpoint "
                             "between epochs): a daemon's stream kept open would fill its ring meanwhile")
    parser.add_argument("--prefetch-batches", type=int, default=4, help="the loader's ready batches per rank")
    parser.add_argument("--daemon-device", choices=("auto", "cpu", "gpu"), default="auto",
                        help="where the daemon decodes (auto: the GPU where there is CUDA)")
    parser.add_argument("--threads", type=int, default=0, help="daemon CPU threads (0: it tunes them)")
    parser.add_argument("--ring-slots", type=int, default=0, help="daemon ring slots per stream (0: sized per stream)")
    parser.add_argument("--daemon-cpus", type=float, default=0.0,
                        help="hold each daemon to this share of one core (a cgroup CPU quota, as a container "
                             "limit is; needs root); 0: no limit")
    parser.add_argument("--serve-args", default="", help="more feeder serve options, e.g. '--cpu-decode-share 0'")
    parser.add_argument("--variant", type=_variant, action="append", default=[],
                        help="a daemon to compare, NAME='SERVE-OPTIONS' (repeatable; each against the same "
                             "synthetic windows), e.g. cpu='--device cpu --threads 12'")
    parser.add_argument("--schedule", default="sample", help="schedule of the time-to-accuracy run")
    parser.add_argument("--target-top1", type=float, default=80.0, help="percent")
    parser.add_argument("--skip-accuracy", action="store_true", help="throughput only")
    parser.add_argument("--skip-throughput", action="store_true", help="time to accuracy only")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--decoded-cache-bytes", default="0",
                        help="the daemon's decoded cache budget (feeder serve --decoded-cache-bytes, e.g. 2G; 0: off)")
    parser.add_argument("--decoded-cache-side", type=int, default=256, help="feeder serve --decoded-cache-side, px")
    parser.add_argument("--json", type=Path, help="write results here (after every window)")
    args = parser.parse_args(argv)
    for name in ("nproc", "batch_size", "window_steps", "settle_steps", "repeats", "prefetch_batches",
                 "images_per_class"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.warmup_steps, args.daemon_cpus, args.pause_s) < 0:
        parser.error("--warmup-steps, --daemon-cpus and --pause-s must be >= 0")
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


def _warnings_of(name: str) -> Callable[[str], None]:
    """Prints a daemon's warnings and errors (a transport it fell back from, a failed
    stream), prefixed with its variant's name; the rest of its output is not shown."""
    def echo(line: str) -> None:
        if " WARNING " in line or " ERROR " in line:
            print(f"{name} daemon: {line.rstrip()}", file=sys.stderr, flush=True)
    return echo


def _started(stack: ExitStack, shards: Path, args: argparse.Namespace) -> dict[str, str]:
    """Every variant's daemon, started side by side (each held to ``--daemon-cpus``),
    stopped side by side when ``stack`` closes; their addresses."""
    daemons = {name: DaemonProcess({"bench": shards}, options, cwd=_REPO, echo=_warnings_of(name))
               for name, options in _variants(args).items()}
    quotas = {}
    for name in daemons if args.daemon_cpus else ():
        quotas[name] = CpuQuota(f"feeder-bench-train-{os.getpid()}-{name}", args.daemon_cpus)
        stack.callback(quotas[name].remove)  # once its daemon has stopped (the stack runs backwards)
    pool = stack.enter_context(ThreadPoolExecutor(len(daemons)))
    stack.callback(lambda: list(pool.map(DaemonProcess.stop, daemons.values())))
    for quota in quotas.values():
        stack.callback(quota.lift)  # before its daemon stops, which it would do at the quota's pace
    addresses = dict(zip(daemons, pool.map(DaemonProcess.start, daemons.values()), strict=True))
    for name, quota in quotas.items():
        quota.add(daemons[name].pid)
    return addresses


def _report(results: dict) -> None:
    speed = results.get("throughput") or {}
    for name, variant in speed.get("variants", {}).items():
        for size, s in variant["sizes"].items():
            spread = s.get("ratio_range") or [float("nan")] * 2
            jpeg = "-" if s["jpeg_percent"] is None else f"{s['jpeg_percent']:.0f} %"
            print(f"{name}, {size} px: step {s['feeder_step_ms']:.1f} ms fed, {s.get('synthetic_step_ms', 0):.1f} "
                  f"synthetic: {s.get('feeder_over_synthetic', 0):.3f}x ({spread[0]:.3f}-{spread[1]:.3f} over "
                  f"{s['windows']} windows of {s['steps_per_window']}); {s['feeder_images_per_s']:,.0f} img/s per "
                  f"rank; device idle {s['feeder_idle_fraction']:.1%} fed, {s.get('synthetic_idle_fraction', 0):.1%} "
                  f"synthetic; host stall {s['feeder_stall_fraction']:.1%}; JPEG engines {jpeg}; over "
                  f"{variant['transport'] or '?'}")
        print(f"{name}: {variant['projection']}")
    if speed:
        print(f"projection basis: {speed['projection_basis']}")
    if "accuracy" in results:
        acc = results["accuracy"]
        reached = acc["time_to_target_s"]
        when = f"{reached:.1f} s" if reached is not None else "not reached"
        print(f"time to {acc['target_top1']:.0f}% top-1: {when} "
              f"({acc['epochs']} epochs, final top-1 {acc['val_top1']:.1%})")


def main(argv: list[str] | None = None) -> dict:
    """Runs the benchmark; prints the figures and returns them."""
    args = parse_args(argv)
    data = resolve(args.shards, None) if args.shards else prepare_sample(args.cache, args.seed,
                                                                          train_per_class=args.images_per_class)
    with ExitStack() as stack, tempfile.TemporaryDirectory(prefix="feeder-bench-train-") as tmp:
        work = Path(tmp)
        json_path = args.json or work / "train.json"
        config = {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}
        document = write_document(json_path, {"command": ["bench/train.py", *(argv or sys.argv[1:])],
                                              "config": config, "results": [{}]})
        addresses = _started(stack, data.shards, args)
        results: dict = {}
        if not args.skip_throughput:
            del document["results"]
            results["throughput"] = _steady(addresses, work, json_path, document, args)
        if not args.skip_accuracy:
            results["accuracy"] = _time_to_accuracy(next(iter(addresses.values())), work, args)
            document = json.loads(json_path.read_text())
            document["results"] = [document["results"][0] | results]
            json_path.write_text(json.dumps(document, indent=2) + "\n")
    _report(results)
    return results


if __name__ == "__main__":
    main()
