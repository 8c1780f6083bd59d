"""Sharder speed: images/s and MB/s of ``feeder shard`` on the sample data.

For each mode and ``--workers`` setting: one untimed warm-up run, then the median of
``--repeats`` timed runs. A run is the whole ``sharder.shard`` call (find inputs,
check and write every image, index, manifest), input files already in the page
cache, output to a fresh folder on the same disk. Modes:

- ``passthrough``: ``--check header --restart-interval 0``: valid JPEGs are only
  checked (headers, end marker) and copied byte for byte.
- ``restarts``: ``--check header``: checked, then rewritten losslessly with restart
  markers on the workers.
- ``decode``: the defaults (``--check decode``, restart markers): valid JPEGs are
  fully decoded on the workers, then rewritten with restart markers.
- ``half-copies``: the defaults and ``--half-copies``: each image also decoded at
  scale 1/2 and encoded again as its half-scale copy.
- ``reencode``: ``--max-side-px 256``, every image decoded, downscaled and re-encoded.
- ``copy``: the upper bound, no sharder: read every input file and append it to one
  output file (same bytes read and written, no checks, no tar, no index).

``--sources`` says what each mode shards: ``tree``, the extracted folder tree; ``tars``,
the same images packed as image-net.org gives them (``ILSVRC2012_img_train.tar`` of
class tars, ``ILSVRC2012_img_val.tar``, the devkit's ``tar.gz``), read where they lie
(``sharder.download_tars``). The output is the same; the figure to compare is
images/s of ``tars`` over ``tree`` in the same run (``copy`` runs on the tree only).

``--pair`` adds, for each mode, what this machine's cores give two CPU-bound
sharders at once: two ``--workers 1`` runs of the whole tree started together
(images/s counts both runs' images over the later one's end), the baseline
``--workers 2`` is held to where the cores do not give two processes 2x.

Example::

    python bench/shard.py --json bench/results/shard.json --plot bench/results/shard.png
    python bench/shard.py --sources tree,tars --modes passthrough,decode --workers 1
"""

from __future__ import annotations

import argparse
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.report import write_document  # noqa: E402
from sharder import SampleDataConfig, ShardConfig, make_sample_data, shard  # noqa: E402
from sharder.download_tars import TRAIN_TAR  # noqa: E402
from sharder.sample_download import write_download  # noqa: E402

__all__ = ["main", "measure"]

REPO = Path(__file__).resolve().parent.parent
MODES: dict[str, dict[str, Any]] = {  # ShardConfig options; "copy" is no shard run
    "passthrough": {"check": "header", "restart_interval": 0},
    "restarts": {"check": "header"},
    "decode": {"check": "decode"},
    "half-copies": {"check": "decode", "half_copies": True},
    "reencode": {"max_side_px": 256},
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--src", type=Path, help="input tree (default: sample data made once under --cache)")
    p.add_argument("--cache", type=Path, default=REPO / ".bench", help="where the default sample data is kept")
    p.add_argument("--classes", type=int, default=10)
    p.add_argument("--train-per-class", type=int, default=200)
    p.add_argument("--val-per-class", type=int, default=10)
    p.add_argument("--workers", default="1,2", help="comma list of --workers settings")
    p.add_argument("--modes", default="copy,passthrough,restarts,decode,half-copies,reencode",
                   help=f"comma list of copy, {', '.join(MODES)}")
    p.add_argument("--sources", default="tree", help="comma list of tree, tars: the extracted tree, or the "
                   "image-net.org tars of the same images")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--ray-nodes", default="", help="comma list of Ray cluster sizes to shard on as well, e.g. 1,2,4 "
                   "(bench/shard_ray.py; needs Ray, root and a cgroup)")
    p.add_argument("--node-cpus", type=float, default=0.25, help="CPU quota of each Ray node, in cores")
    p.add_argument("--pair", action="store_true", help="also two --workers 1 runs at once, per mode")
    p.add_argument("--json", type=Path, help="write results, configuration and git revision here")
    p.add_argument("--plot", type=Path, help="write a PNG bar chart here")
    return p.parse_args(argv)


def _sample_src(args: argparse.Namespace) -> Path:
    if args.src is not None:
        return args.src
    src = args.cache / f"shard-sample-c{args.classes}-t{args.train_per_class}-v{args.val_per_class}"
    if not (src / "LOC_synset_mapping.txt").is_file():
        shutil.rmtree(src, ignore_errors=True)
        make_sample_data(SampleDataConfig(src, args.classes, args.train_per_class, args.val_per_class))
    return src


def _download_of(src: Path) -> Path:
    """The image-net.org tars of the tree ``src``, made once beside it."""
    download = src.with_name(src.name + "-download")
    if not (download / TRAIN_TAR).is_file():
        shutil.rmtree(download, ignore_errors=True)
        write_download(src, download)
    for tar in download.iterdir():
        tar.read_bytes()  # into the page cache, as the tree's files are
    return download


def _input_bytes(src: Path) -> tuple[int, int]:
    """Image count and bytes under ``src``; reading them also warms the page cache."""
    files = [p for p in src.rglob("*") if p.suffix.lower() in (".jpeg", ".jpg")]
    return len(files), sum(len(p.read_bytes()) for p in files)


def copy_files(src: Path, out: Path) -> None:
    """The upper bound: walk SRC, read every JPEG and append it to one file, fsynced."""
    out.mkdir()
    with open(out / "all.bin", "wb") as sink:
        for dirpath, dirnames, filenames in os.walk(src):
            dirnames.sort()
            for name in sorted(filenames):
                if name.lower().endswith((".jpeg", ".jpg")):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        sink.write(f.read())
        sink.flush()
        os.fsync(sink.fileno())


def _cpu_s() -> float:
    """CPU seconds of this process and its finished children (pool workers are joined)."""
    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


def measure(src: Path, mode: str, workers: int, repeats: int, scratch: Path) -> tuple[list[float], list[float]]:
    """Wall and CPU seconds of ``repeats`` runs of ``mode`` after one warm-up run.

    CPU seconds do not depend on other work on the machine; wall seconds do.
    """
    seconds, cpu_seconds = [], []
    for attempt in range(repeats + 1):
        out = scratch / f"out-{mode}-{workers}-{attempt}"
        started, cpu_started = time.perf_counter(), _cpu_s()
        if mode == "copy":
            copy_files(src, out)
        elif workers == 0:  # a pair of --workers 1 runs at once
            _pair(src, out, mode)
        else:
            shard(ShardConfig(src, out, workers=workers, **MODES[mode]))
        elapsed, cpu = time.perf_counter() - started, _cpu_s() - cpu_started
        shutil.rmtree(out)
        if attempt > 0:
            seconds.append(elapsed)
            cpu_seconds.append(cpu)
    return seconds, cpu_seconds


def _pair(src: Path, out: Path, mode: str) -> None:
    """Two ``--workers 1`` runs of ``src`` at once, in two processes."""
    import multiprocessing

    context = multiprocessing.get_context("fork")
    runs = [context.Process(target=shard, args=(ShardConfig(src, out / str(i), workers=1, **MODES[mode]),))
            for i in range(2)]
    out.mkdir()
    for run in runs:
        run.start()
    for run in runs:
        run.join()
        if run.exitcode:
            raise SystemExit(f"bench: a paired run of {mode} exited with {run.exitcode}")


def _write_json(path: Path, config: dict, rows: list[dict]) -> None:
    write_document(path, {
        "benchmark": "shard",
        "created_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "command": sys.argv,
        "config": config,
        "results": rows,
    })


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 3.5))
    shown = {r.get("source", "tree") for r in rows} != {"tree"}  # name the source when it varies
    labels = [r["mode"] if r["mode"] == "copy" else f"{r['mode']}\nray {r['nodes']}x{r['node_cpus']}" if "nodes" in r
              else f"{r['mode']}{' ' + r['source'] if shown else ''}\n--workers {r['workers']}" for r in rows]
    colours = {"copy": "tab:gray", "passthrough": "tab:blue", "restarts": "tab:purple", "decode": "tab:green",
               "half-copies": "tab:olive", "reencode": "tab:orange"}
    ax.bar(labels, [r["images_per_s"] for r in rows], color=[colours[r["mode"]] for r in rows])
    ax.set_ylabel("images/s (median)")
    ax.set_title("feeder shard on the sample data")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def _compare_sources(rows: list[dict]) -> None:
    """Each ``tars`` row's images/s over its ``tree`` row's (same mode and workers), as
    ``over_tree``, printed."""
    tree = {(r["mode"], r["workers"]): r["images_per_s"] for r in rows if r["source"] == "tree"}
    for row in rows:
        if row["source"] == "tars" and (row["mode"], row["workers"]) in tree:
            row["over_tree"] = row["images_per_s"] / tree[row["mode"], row["workers"]]
            print(f"{row['mode']:<12} --workers {row['workers']}: tars at {row['over_tree']:.2f}x the tree's images/s")


def _runs(args: argparse.Namespace) -> list[tuple[str, str]]:
    """(mode, source) pairs in order; ``copy`` reads the tree only."""
    sources = args.sources.split(",")
    if unknown := set(sources) - {"tree", "tars"}:
        raise SystemExit(f"bench: --sources: unknown {', '.join(sorted(unknown))} (tree, tars)")
    return [(mode, source) for mode in args.modes.split(",") for source in (["tree"] if mode == "copy" else sources)]


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    src = _sample_src(args)
    images, input_bytes = _input_bytes(src)
    sources = {"tree": src, "tars": _download_of(src) if "tars" in args.sources.split(",") else src}
    load_before = os.getloadavg()[0]  # other work on the machine skews every figure
    rows = []
    with tempfile.TemporaryDirectory(dir=args.cache) as scratch:
        for mode, source in _runs(args):
            settings = [int(w) for w in args.workers.split(",")] + ([0] if args.pair else [])
            for workers in [1] if mode == "copy" else settings:
                seconds, cpu_seconds = measure(sources[source], mode, workers, args.repeats, Path(scratch))
                median = statistics.median(seconds)
                run_images, run_bytes = (2 * images, 2 * input_bytes) if workers == 0 else (images, input_bytes)
                row = {"mode": mode, "source": source, "workers": workers if workers else "pair of 1",
                       "images": run_images,
                       "input_bytes": run_bytes,
                       "seconds": seconds, "cpu_seconds": cpu_seconds, "median_s": median,
                       "images_per_s": run_images / median, "mb_per_s": run_bytes / median / 1e6,
                       "cpu_ms_per_image": 1000 * statistics.median(cpu_seconds) / run_images}  # fmt: skip
                rows.append(row)
                print(
                    f"{mode:<12} {source:<5} --workers {row['workers']}: {row['images_per_s']:7.0f} images/s "
                    f"{row['mb_per_s']:7.1f} MB/s "
                    f"{row['cpu_ms_per_image']:6.2f} CPU ms/image (median of {args.repeats})"
                )
        if args.ray_nodes:
            from bench.shard_ray import measure_nodes

            nodes = [int(n) for n in args.ray_nodes.split(",")]
            for mode in args.modes.split(","):
                rows += measure_nodes(src, images, mode, MODES[mode], nodes, args.node_cpus, args.repeats,
                                      Path(scratch))
    _compare_sources(rows)
    config = {key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}
    config.update(src=str(src), load_average_1min_before=load_before, load_average_1min_after=os.getloadavg()[0])
    if args.json:
        _write_json(args.json, config, rows)
    if args.plot:
        _plot(rows, args.plot)
    return rows


if __name__ == "__main__":
    main()
