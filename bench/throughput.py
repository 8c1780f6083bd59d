"""Images/s of feeder beside the loaders users would otherwise pick, on the same data.

Every loader does the same work (RandomResizedCrop to ``--image-size``, horizontal
flip, uint8 batches at the consumer, ``--split``) with the same CPU budget
(``--threads``), each in a fresh process pinned to that many CPUs, one after another
in one invocation. Setup is not timed; after a warm-up, the median of ``--repeats``
windows of ``--seconds`` is reported, with CPU seconds per image and the peak memory
of the loader's whole process tree (workers and daemon included). Loaders whose
packages clash with the project's (FFCV, SPDL) run in a virtual environment of their
own, made the first time under ``--cache`` (``bench/venvs.py``), and a loader that
keeps the data in a format of its own writes it there once, before its first start.

``--store s3`` runs the object-store comparison instead (``bench/s3_store.py``): a
SeaweedFS started for the run holds the data (a larger sample by default), and feeder
from it (``feeder-s3``: epoch 1 with an empty node cache, epoch 2 from the cache),
feeder from local disk and the peers a user would pick for a store (MosaicML
Streaming, WebDataset, LitData, each in a venv of its own reading its own copy from
the same store, its download cache emptied at every start) are measured by epoch,
with the store's raw read bandwidth.

Example::

    python bench/throughput.py --image-size 224 --json bench/results/throughput.json \\
        --plot bench/results/throughput.png
    python bench/throughput.py --store s3 --rounds 3 --json bench/results/throughput_s3.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import venvs  # noqa: E402
from bench.data import SAMPLE_TRAIN_PER_CLASS, BenchData, prepare_sample, prepare_store_sample, resolve  # noqa: E402
from bench.loaders import LOADERS, STORE_LOADERS, LoaderSpec, LoaderUnavailable, loader_module  # noqa: E402
from bench.measure import Schedule  # noqa: E402
from bench.report import format_store_table, format_table, format_targets, plot, write_json  # noqa: E402
from bench.s3_store import StoreRun, raw_bandwidth, started_store, upload_tree  # noqa: E402
from bench.summary import (  # noqa: E402
    add_ratios,
    add_store_ratios,
    check_store_targets,
    check_targets,
    summarise,
    summarise_runs,
)
from bench.watched import NO_MEMORY, REPO, stop_workers, watched  # noqa: E402
from bench.worker import request_for  # noqa: E402
from core.cli import parse_bytes  # noqa: E402
from core.errors import FeederError  # noqa: E402
from shards.reader import ShardDataset  # noqa: E402

__all__ = ["main", "parse_args", "run_loader"]

DEFAULT_CACHE = REPO / ".bench"
# Time a loader may take beyond its schedule (process start, imports, setup, shutdown).
_SETUP_ALLOWANCE_S = 300.0
# Time a loader's ``prepare`` step may take (FFCV writing 20,000 images on 2 CPUs).
_PREPARE_LIMIT_S = 3600.0
# What --store s3 measures unless --loaders says otherwise.
_STORE_DEFAULT = ("feeder-s3", "feeder-shm", "streaming", "webdataset-s3", "litdata")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", type=Path, help="shard directory (default: the sample data, made once under --cache)")
    p.add_argument("--source", type=Path, help="JPEG tree the shards came from (default: the manifest's source)")
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE,
                   help="where the default sample data, the peers' virtual environments and their dataset files "
                   "are kept")
    p.add_argument("--split", default="train")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--image-size", type=int, default=224, help="output side in pixels")
    p.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="CPU budget of every loader")
    p.add_argument("--seconds", type=float, default=10.0, help="length of each measured window")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds consumed before measuring")
    p.add_argument("--repeats", type=int, default=3, help="measured windows per loader start")
    p.add_argument("--rounds", type=int, default=1,
                   help="start every loader this many times, in turn (spreads slow drifts of a shared "
                   "machine over all loaders); the median is over all windows of all rounds")
    p.add_argument("--loaders", help=f"comma list of {', '.join(LOADERS)} "
                   f"(default: all but {', '.join(STORE_LOADERS)}; with --store s3: {','.join(_STORE_DEFAULT)})")
    p.add_argument("--store", choices=("local", "s3"), default="local",
                   help="s3: the data in a SeaweedFS started for the run, measured by epoch (--epochs 2 unless given)")
    p.add_argument("--images-per-class", type=int, default=SAMPLE_TRAIN_PER_CLASS,
                   help="without --data: training images per class of the sample (10 classes); more makes "
                   "an epoch long enough to time when later epochs come from the decoded cache")
    p.add_argument("--store-images-per-class", type=int, default=600,
                   help="--store s3 without --data: training images per class of its sample (10 classes)")
    p.add_argument("--clients", type=int, default=1, help="concurrent consumers of one daemon (feeder loaders)")
    p.add_argument("--jobs", type=int, default=1,
                   help="concurrent jobs on one daemon (feeder loaders): each its own job id and seed, the "
                   "whole split each epoch; the row is their total images/s")
    p.add_argument("--epochs", type=int, default=0,
                   help="measure this many epochs, each a window, instead of --seconds windows: epoch 1 "
                   "(a cache filling) is reported apart from the later ones; no warm-up")
    p.add_argument("--decoded-cache-bytes", default="0", help="feeder serve --decoded-cache-bytes (e.g. 2G)")
    p.add_argument("--decoded-cache-side", type=int, default=256, help="feeder serve --decoded-cache-side, px")
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: DALI and feeder decode on CUDA")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, help="write the results and the configuration here")
    p.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    args = p.parse_args(argv)
    if args.loaders is None:
        local = ",".join(n for n in LOADERS if n not in STORE_LOADERS)
        args.loaders = ",".join(_STORE_DEFAULT) if args.store == "s3" else local
    if args.store == "s3" and not args.epochs:
        args.epochs = 2
    unknown = [n for n in args.loaders.split(",") if n not in LOADERS]
    if unknown:
        p.error(f"unknown loader(s) {', '.join(unknown)}; choose from {', '.join(LOADERS)}")
    if args.device == "gpu" and not _cuda_available():
        p.error("--device gpu needs a CUDA device, and none is visible")
    counts = (args.batch_size, args.image_size, args.threads, args.repeats, args.rounds, args.clients, args.jobs)
    if min(counts) < 1 or args.seconds <= 0:
        p.error("--batch-size, --image-size, --threads, --repeats, --rounds, --clients, --jobs and --seconds "
                "must be positive")
    if args.jobs > 1 and args.clients > 1:
        p.error("--jobs and --clients: choose one (several ranks of one job, or several jobs of one rank)")
    if args.epochs == 1 or args.epochs < 0:
        p.error("--epochs: at least 2 (the first is reported apart), or 0 for --seconds windows")
    stray = [n for n in args.loaders.split(",") if n in STORE_LOADERS]
    if args.store != "s3" and stray:
        p.error(f"{', '.join(stray)} read from an object store: add --store s3")
    if args.store_images_per_class < 1 or args.images_per_class < 1:
        p.error("--images-per-class and --store-images-per-class must be positive")
    return args


def _cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def run_loader(name: str, spec: LoaderSpec, schedule: Schedule, workdir: Path, python: str = sys.executable,
               step: str = "measure") -> dict:
    """Runs loader ``name`` once in a fresh process of ``python``.

    Args:
        step: ``measure``, or ``prepare`` (its module's ``prepare``: see ``bench.worker``).

    Returns:
        ``{"result": what bench.worker wrote (or {"loader", "error"}), "memory": peaks,
        "load_average_1m": machine load before the start}``.
    """
    stem = workdir / f"{name}-{len(list(workdir.glob(f'{name}-*.log')))}"
    request, result, log = (stem.with_suffix(s) for s in (".request.json", ".result.json", ".log"))
    request.write_text(json.dumps(request_for(name, spec, schedule, step)))
    limit_s = _SETUP_ALLOWANCE_S + 3 * (schedule.warmup_s + schedule.repeats * schedule.seconds)
    # Runnable processes on the machine before this loader starts: a busy machine
    # (other jobs) makes every figure of the run less trustworthy.
    load = os.getloadavg()[0]
    try:
        command = [python, "-m", "bench.worker", str(request), str(result)]
        code, memory = watched(command, log, _PREPARE_LIMIT_S if step == "prepare" else limit_s)
    except OSError as e:  # the interpreter is gone (a virtual environment removed meanwhile)
        return {"result": {"loader": name, "error": f"cannot start {python}: {e}"}, "memory": dict(NO_MEMORY),
                "load_average_1m": load}
    if result.is_file():
        outcome = json.loads(result.read_text())
    else:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        outcome = {"loader": name, "error": f"exit {code}: " + " | ".join(tail)}
    return {"result": outcome, "memory": memory, "load_average_1m": load}


def _epoch_batches(data: BenchData, split: str, ranks: int, batch_size: int) -> int:
    """Batches of one rank's epoch (feeder's ``drop`` policy)."""
    samples = len(ShardDataset.open("bench", data.shards).splits[split])
    return max(2, samples // ranks // batch_size)


def _data(args: argparse.Namespace) -> BenchData:
    if args.data is None and args.store == "s3":
        return prepare_store_sample(args.cache, args.store_images_per_class, seed=args.seed)
    if args.data is None:
        return prepare_sample(args.cache, seed=args.seed, train_per_class=args.images_per_class)
    return resolve(args.data, args.source)


def _config(args: argparse.Namespace, data: BenchData, names: list[str]) -> dict:
    return {
        "data": str(data.shards), "source": str(data.source) if data.source else None, "split": args.split,
        "batch_size": args.batch_size, "image_size_px": args.image_size, "threads": args.threads,
        "seconds": args.seconds, "warmup_s": args.warmup, "repeats": args.repeats, "rounds": args.rounds,
        "loaders": names, "clients": args.clients, "device": args.device, "seed": args.seed, "jobs": args.jobs,
        "epochs": args.epochs, "images_per_class": args.images_per_class if args.data is None else None,
        "decoded_cache_bytes": args.decoded_cache_bytes, "decoded_cache_side_px": args.decoded_cache_side,
    }


def _progress(index: int, total: int, run: dict) -> None:
    row = summarise(run["result"], run["memory"])
    figure = row.get("error") or row.get("skipped") or f"{row['images_per_s']:.0f} images/s"
    print(f"[{index}/{total}] {row['loader']}: {figure}", file=sys.stderr, flush=True)


def _stand_in(result: dict) -> dict:
    """A run that stands for every start of a loader that cannot start (skipped or failed)."""
    return {"result": result, "memory": dict(NO_MEMORY), "load_average_1m": os.getloadavg()[0]}


def _ready(name: str, spec: LoaderSpec, schedule: Schedule, workdir: Path) -> tuple[str, dict | None]:
    """Makes loader ``name`` ready to start: the interpreter it runs in (its own virtual
    environment's, made first if needed, or this one), and its ``prepare`` step run.

    Returns:
        ``(interpreter, None)``, or ``(interpreter, a run standing for all its starts)``
        when it is skipped (its environment cannot be made) or its preparation failed.
    """
    try:
        module = loader_module(name)
    except LoaderUnavailable as e:  # its package is not installed: one line, the other loaders run
        return sys.executable, _stand_in({"loader": name, "skipped": str(e)})
    environment = getattr(module, "ENVIRONMENT", None)
    python = sys.executable
    if environment is not None:
        try:
            python = str(venvs.interpreter(environment, spec.cache or DEFAULT_CACHE))
        except LoaderUnavailable as e:
            return python, _stand_in({"loader": name, "skipped": str(e)})
    if not hasattr(module, "prepare"):
        return python, None
    print(f"throughput: preparing {name}'s data (written once, then kept; not timed)", file=sys.stderr, flush=True)
    outcome = run_loader(name, spec, schedule, workdir, python, step="prepare")["result"]
    return python, (None if outcome.get("prepared") else _stand_in(outcome))


def _measure_all(names: list[str], spec: LoaderSpec, schedule: Schedule, rounds: int,
                 ready: dict[str, tuple[str, dict | None]] | None = None,
                 measured: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """Every loader in turn, ``rounds`` times over; one summary row per loader.

    Args:
        ready: what ``_ready`` returned for loaders made ready before (others are made
            ready before their first start).
        measured: called after each run with the rows of the loaders run so far (a
            run cut short keeps what finished).
    """
    runs: dict[str, list[dict]] = {name: [] for name in names}
    ready = dict(ready or {})
    with tempfile.TemporaryDirectory(prefix="feeder-bench-") as tmp:
        for i in range(rounds * len(names)):
            name = names[i % len(names)]
            if name not in ready:
                ready[name] = _ready(name, spec, schedule, Path(tmp))
            python, stand_in = ready[name]
            if stand_in is None:
                runs[name].append(run_loader(name, spec, schedule, Path(tmp), python))
            elif runs[name]:
                continue  # reported once
            else:
                runs[name].append(stand_in)
            _progress(i + 1, rounds * len(names), runs[name][-1])
            if measured is not None:
                measured([summarise_runs(runs[n]) for n in names if runs[n]])
    return [summarise_runs(runs[name]) for name in names]


def _upload_peer_copies(run: StoreRun, names: list[str], spec: LoaderSpec, schedule: Schedule) -> dict:
    """Every loader of ``names`` made ready (its ``prepare`` step run), and the dataset
    it wrote (``local_copy``) uploaded to the store under its ``STORE_PREFIX``."""
    ready = {}
    with tempfile.TemporaryDirectory(prefix="feeder-bench-prepare-") as tmp:
        for name in names:
            ready[name] = _ready(name, spec, schedule, Path(tmp))
            if ready[name][1] is not None:
                continue  # skipped or failed: nothing to upload
            module = loader_module(name)
            if hasattr(module, "local_copy"):
                size = upload_tree(run, module.local_copy(spec), module.STORE_PREFIX)
                print(f"throughput: {name}'s copy uploaded to {run.url}/{module.STORE_PREFIX} ({size / 1e6:.0f} MB)",
                      file=sys.stderr, flush=True)
    return ready


def _measure_store(args: argparse.Namespace, names: list[str], spec: LoaderSpec,
                   schedule: Schedule) -> tuple[list[dict], list[dict], dict]:
    """The ``--store s3`` run: rows, feeder-s3's targets, and the store's figures."""
    with tempfile.TemporaryDirectory(prefix="feeder-bench-s3-") as tmp, started_store(Path(tmp), spec.shards) as run:
        spec = replace(spec, store_url=run.url, store_endpoint=run.server.endpoint_url)
        ready = _upload_peer_copies(run, names, spec, schedule)
        before = raw_bandwidth(run, spec.shards, spec.split, spec.threads)
        rows = _measure_all(names, spec, schedule, args.rounds, ready)
        after = raw_bandwidth(run, spec.shards, spec.split, spec.threads)
    add_store_ratios(rows)
    bandwidth = {key: min(before[key], after[key]) for key in before}
    return rows, check_store_targets(rows), {"raw_bandwidth": bandwidth, "before": before, "after": after}


def main(argv: list[str] | None = None) -> int:
    """Runs the benchmark; returns 0 when every loader produced correct batches."""
    args = parse_args(argv)
    previous = {signum: signal.signal(signum, stop_workers) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _run(args, argv)
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _command(argv: list[str] | None) -> list[str]:
    return [f"bench/{Path(__file__).name}", *(argv if argv is not None else sys.argv[1:])]


def _writer(args: argparse.Namespace, data: BenchData, names: list[str],
            argv: list[str] | None) -> Callable[[list[dict]], None] | None:
    """What writes ``--json`` after each run (marked ``partial`` until the last)."""
    if not args.json:
        return None
    config = _config(args, data, names) | {"partial": True}

    def write(rows: list[dict]) -> None:
        add_ratios(rows)
        write_json(args.json, config, rows, _command(argv), check_targets(rows))
    return write


def _run(args: argparse.Namespace, argv: list[str] | None) -> int:
    try:
        data, names = _data(args), args.loaders.split(",")
    except (OSError, FeederError) as e:  # no shards there, or the sample data cannot be made
        print(f"throughput: {e}", file=sys.stderr)
        return 2
    spec = LoaderSpec(shards=data.shards, source=data.source, split=args.split, batch_size=args.batch_size,
                      image_size_px=args.image_size, threads=args.threads, device=args.device, seed=args.seed,
                      clients=max(args.clients, args.jobs), separate_jobs=args.jobs > 1,
                      decoded_cache_bytes=parse_bytes(args.decoded_cache_bytes, "--decoded-cache-bytes"),
                      decoded_cache_side=args.decoded_cache_side, cache=args.cache)
    schedule = Schedule(warmup_s=args.warmup, seconds=args.seconds, repeats=args.repeats)
    if args.epochs:
        schedule = Schedule(warmup_s=0, seconds=args.seconds, repeats=args.epochs,
                            epoch_batches=_epoch_batches(data, args.split, args.clients, args.batch_size))
    store: dict = {}
    if args.store == "s3":
        rows, targets, store = _measure_store(args, names, spec, schedule)
        print("\n".join(filter(None, [format_store_table(rows, store["raw_bandwidth"]),
                                       format_targets(targets, "feeder-s3")])))
    else:
        rows = _measure_all(names, spec, schedule, args.rounds, measured=_writer(args, data, names, argv))
        add_ratios(rows)
        targets = check_targets(rows)
        print("\n".join(filter(None, [format_table(rows), format_targets(targets)])))
    config = _config(args, data, names) | ({"store": "s3", **store} if store else {})
    if args.json:
        write_json(args.json, config, rows, _command(argv), targets)
    if args.plot:
        title = (f"{args.split}, {args.image_size} px, batch {args.batch_size}, {args.threads} CPU threads, "
                 f"{args.device}")
        plot(args.plot, rows, title, targets)
    return 0 if all("error" not in r and not r.get("problems") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
