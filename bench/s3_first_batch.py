"""How soon a stream's first batch comes from a dataset in an object store: a
``feeder serve`` process over the bench's shards in a SeaweedFS it starts on this
machine (:mod:`bench.seaweedfs`), with an empty node-local cache (cold: the batch's
samples are ranged GETs, the shards' downloads start behind them) and again once the
cache holds the shards (warm).

Each trial starts a fresh daemon on a fresh cache directory; the time is from the
``StreamBatches`` call to the first batch in hand (the stream's pipeline is built in
it, as for any new stream), then the rest of the epoch is read to fill the cache,
and a second stream's first batch is timed. For reference, a fresh daemon serving
the same shards from the local disk times its first batch too (not with
``--no-local``). Reported: each trial and the median.

Usage::

    python bench/s3_first_batch.py --json first_batch.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import grpc

if __package__ in (None, ""):  # run as a script: python bench/s3_first_batch.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.data import prepare_sample, resolve  # noqa: E402
from bench.report import write_document  # noqa: E402
from bench.seaweedfs import SeaweedFS, seaweedfs  # noqa: E402
from launcher.daemon_process import DaemonProcess  # noqa: E402
from protos import feeder_pb2, feeder_pb2_grpc  # noqa: E402
from shards.objects import ObjectUrl  # noqa: E402
from shards.store import ObjectStore, StoreOptions  # noqa: E402

__all__ = ["main", "measure", "parse_args"]

DEFAULT_CACHE = Path(__file__).resolve().parents[1] / ".bench"
_TIMES = ("cold_first_batch_s", "warm_first_batch_s", "local_first_batch_s")


def _upload(server: SeaweedFS, shards: Path, url: str) -> None:
    """Every file of ``shards`` to ``url``, the manifest last."""
    store = ObjectStore(ObjectUrl.parse(url), StoreOptions(endpoint_url=server.endpoint_url))
    for path in sorted((p for p in shards.rglob("*") if p.is_file()), key=lambda p: p.name == "manifest.json"):
        store.put_file(path.relative_to(shards).as_posix(), path)


def _first_batch_s(stub: feeder_pb2_grpc.FeederStub, args: argparse.Namespace, read_all: bool,
                   dataset: str = "remote") -> float:
    """Seconds from a stream's request to its first batch; then the rest of its
    epoch read (``read_all``) or the stream cancelled."""
    request = feeder_pb2.StreamRequest(dataset=dataset, split=args.split, world_size=1, batch_size=args.batch_size,
                                       image_size=args.image_size, seed=args.seed)
    started = time.perf_counter()
    stream = stub.StreamBatches(request)
    next(stream)
    waited_s = time.perf_counter() - started
    if read_all:
        for _ in stream:
            pass
    else:
        stream.cancel()
    return waited_s


def _local_first_batch_s(shards: Path, args: argparse.Namespace) -> float:
    """The first batch of a fresh daemon serving ``shards`` from the local disk: the
    same pipeline built in the request, the same decoding, no store."""
    daemon = DaemonProcess({"local": shards}, ("--device", "cpu", "--threads", str(args.threads)))
    with daemon, grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        return _first_batch_s(feeder_pb2_grpc.FeederStub(channel), args, read_all=False, dataset="local")


def _trial(server: SeaweedFS, url: str, args: argparse.Namespace, workdir: Path, tars: int) -> dict[str, float]:
    """A fresh daemon on an empty cache: the cold first batch and the cold epoch's
    cache counters, then (once its ``tars`` shards are cached) the warm first batch
    (of a second stream: its pipeline may be the first one's, kept by the daemon)."""
    cache = Path(tempfile.mkdtemp(dir=workdir, prefix="cache-"))
    daemon = DaemonProcess({"remote": url}, ("--device", "cpu", "--threads", str(args.threads), "--cache-dir",
                                             str(cache), "--s3-endpoint", server.endpoint_url))
    with daemon, grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", -1)]) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        cold_s = _first_batch_s(stub, args, read_all=True)
        cold = stub.GetStats(feeder_pb2.StatsRequest())
        deadline = time.monotonic() + 120
        while stub.GetStats(feeder_pb2.StatsRequest()).shard_cache_shards < tars and time.monotonic() < deadline:
            time.sleep(0.1)  # the split's shards downloaded
        warm_s = _first_batch_s(stub, args, read_all=False)
        stats = stub.GetStats(feeder_pb2.StatsRequest())
    return {"cold_first_batch_s": round(cold_s, 3), "warm_first_batch_s": round(warm_s, 3),
            "cold_epoch_misses": cold.shard_cache_misses, "cold_epoch_hits": cold.shard_cache_hits,
            "shards_cached": stats.shard_cache_shards}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv``; None: ``sys.argv``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data", type=Path, help="shard directory (default: the bench's sample data)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sample data is kept")
    parser.add_argument("--split", default="train")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--image-size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)))
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--local", action=argparse.BooleanOptionalAction, default=True,
                        help="also time a fresh daemon's first batch from the local disk")
    parser.add_argument("--json", type=Path)
    return parser.parse_args(argv)


def measure(server: SeaweedFS, shards: Path, url: str, args: argparse.Namespace, workdir: Path) -> dict[str, object]:
    """Upload ``shards`` to ``url`` (an empty prefix of a bucket on ``server``) and
    time ``args.trials`` first batches, each of a fresh daemon on a fresh cache under
    ``workdir``; the credentials are the environment's.

    Returns:
        ``trials`` (each trial's figures) and ``median`` (of the first-batch times).
    """
    _upload(server, shards, url)
    tars = len(list((shards / args.split).glob("*.tar")))
    trials = []
    for number in range(args.trials):
        trial = _trial(server, url, args, workdir, tars)
        if args.local:
            trial["local_first_batch_s"] = round(_local_first_batch_s(shards, args), 3)
        trials.append(trial)
        print(f"trial {number + 1}: {json.dumps(trials[-1])}", flush=True)
    median = {key: statistics.median(float(t[key]) for t in trials) for key in _TIMES if key in trials[0]}
    loaders = (f"{key.removesuffix('_first_batch_s')} {value:.2f} s" for key, value in median.items())
    print("median: " + ", ".join(loaders))
    return {"trials": trials, "median": median}


def main(argv: list[str] | None = None) -> dict[str, object]:
    args = parse_args(argv)
    data = resolve(args.data, None) if args.data else prepare_sample(args.cache)
    with tempfile.TemporaryDirectory() as tmp, seaweedfs(Path(tmp) / "s3") as server:
        os.environ.update(server.environment())
        server.filesystem().create_dir("bench")
        figures = measure(server, data.shards, "s3://bench/shards", args, Path(tmp))
    document: dict[str, object] = {"command": sys.argv, "config": {k: str(v) for k, v in vars(args).items()},
                                   **figures}
    if args.json is not None:
        write_document(args.json, document)
    return document


if __name__ == "__main__":
    main()
