"""What the node cache costs and saves, epoch by epoch: a ``feeder serve`` over the
bench's shards in a SeaweedFS it starts on this machine (:mod:`bench.seaweedfs`), with
an empty ``--cache-dir`` of a given ``--cache-bytes``, read by one ``FeederLoader``
(224 px, batch 64, shared memory) for ``--epochs`` shuffled epochs.

Per epoch: images/s, the store's bytes over the split's (``store_bytes_fetched``
from ``GetStats``: a cold epoch with the cache on should take each byte once; with
the cache at half the split, later epochs about half), the store's requests, the
cache's hits, misses, downloads and evictions, the daemon's CPU ms per image (its
process, threads and all), and the median and p99 wait for a batch.

Usage::

    python bench/s3_cache.py --cache-bytes 64G,half --epochs 3 --json bench/results/s3_cache.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script: python bench/s3_cache.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import prepare_store_sample  # noqa: E402
from bench.report import write_document  # noqa: E402
from bench.s3_first_batch import _upload  # noqa: E402
from bench.seaweedfs import seaweedfs  # noqa: E402
from clients import FeederLoader  # noqa: E402
from core.cli import parse_bytes  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402
from protos import feeder_pb2, feeder_pb2_grpc  # noqa: E402

__all__ = ["main", "measure", "parse_args"]

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".bench"
_COUNTERS = ("store_bytes_fetched", "store_requests", "shard_cache_hits", "shard_cache_misses",
             "shard_cache_downloads", "shard_cache_evictions")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--cache-bytes", default="64G,half",
                   help="budgets to measure, comma-separated: sizes (64G) or 'half' (half the split's tars)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--images-per-class", type=int, default=600, help="the sample's training images per class")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sample data is kept")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.epochs < 1:
        p.error("--epochs must be at least 1")
    return args


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _stats(address: str) -> dict[str, int]:
    with grpc.insecure_channel(address) as channel:
        stats = feeder_pb2_grpc.FeederStub(channel).GetStats(feeder_pb2.StatsRequest(), timeout=10)
    return {name: int(getattr(stats, name)) for name in _COUNTERS}


def _epoch(loader: FeederLoader, daemon: DaemonProcess, split_bytes: int) -> dict:
    """One epoch of ``loader``: its figures (see the module's docstring)."""
    before, cpu_before = _stats(daemon.address), _cpu_s(daemon.pid)
    images, waits = 0, []
    started = asked = time.perf_counter()
    for batch, _ in loader:
        waits.append(time.perf_counter() - asked)
        images += len(batch)
        asked = time.perf_counter()
    seconds = time.perf_counter() - started
    after, cpu = _stats(daemon.address), _cpu_s(daemon.pid) - cpu_before
    counts = {name: after[name] - before[name] for name in _COUNTERS}
    waits.sort()
    return {"images_per_s": round(images / seconds, 1), "seconds": round(seconds, 3),
            "store_x_split": round(counts.pop("store_bytes_fetched") / split_bytes, 3), **counts,
            "daemon_cpu_ms_per_image": round(1000 * cpu / images, 3),
            "wait_median_ms": round(1000 * statistics.median(waits), 1),
            "wait_p99_ms": round(1000 * waits[int(0.99 * (len(waits) - 1))], 1)}


def measure(args: argparse.Namespace) -> list[dict]:
    """A fresh daemon and cache per budget; rows of epochs."""
    data = prepare_store_sample(args.cache, args.images_per_class)
    split_bytes = sum(p.stat().st_size for p in (data.shards / "train").glob("*.tar"))
    rows = []
    with tempfile.TemporaryDirectory(prefix="feeder-s3-cache-") as tmp, seaweedfs(Path(tmp) / "store") as server:
        os.environ.update(server.environment())
        url = "s3://bench/feeder"
        _upload(server, data.shards, url)
        for n, budget in enumerate(args.cache_bytes.split(",")):
            cache_bytes = split_bytes // 2 if budget == "half" else parse_bytes(budget, "--cache-bytes")
            options = ("--device", "cpu", "--threads", str(args.threads), "--s3-endpoint", server.endpoint_url,
                       "--cache-dir", str(Path(tmp) / f"cache-{n}"), "--cache-bytes", str(cache_bytes))
            with DaemonProcess({"bench": url}, options, die_with_parent=True) as daemon:
                loader = FeederLoader("bench", address=daemon.address, split="train", batch_size=64, image_size=224,
                                      seed=0, normalize=False, augment="train", transport="shm")
                with loader:
                    for epoch in range(1, args.epochs + 1):
                        row = {"cache_bytes": cache_bytes, "cache_x_split": round(cache_bytes / split_bytes, 2),
                               "epoch": epoch, **_epoch(loader, daemon, split_bytes)}
                        print(f"s3_cache: cache {budget} epoch {epoch}: {row['images_per_s']:.0f} images/s, "
                              f"{row['store_x_split']:.3f}x the split from the store, {row['store_requests']} "
                              f"requests, {row['daemon_cpu_ms_per_image']:.3f} CPU ms/image, p99 wait "
                              f"{row['wait_p99_ms']:.0f} ms", file=sys.stderr, flush=True)
                        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = measure(args)
    if args.json is not None:
        write_document(args.json, {"command": ["python", "bench/s3_cache.py", *(argv or sys.argv[1:])],
                                   "config": {k: str(v) for k, v in vars(args).items() if k != "json"}, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
