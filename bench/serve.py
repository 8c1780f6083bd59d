"""What the daemon costs: images/s a gRPC client receives from ``feeder serve`` beside
in-process DALI running the same pipeline (same plan, same reader, same threads).

The daemon runs as its own process (``feeder serve --port 0``), as it does beside a
training job; the client turns every batch's bytes into an NHWC uint8 array. The
in-process side runs ``feeder.pipeline.PipelineRunner`` on bytes from
``shards.reader`` in this process. The two alternate, repeat after repeat, each
after a warm-up, so machine noise hits both; the medians and their ratio are
reported (the daemon aims for >= 0.85).

Example::

    python bench/serve.py --image-size 224 --threads 2 --json bench/results/serve.json \\
        --plot bench/results/serve.png
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Generator, Iterator, Sized
from itertools import count
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import grpc  # noqa: E402
import numpy as np  # noqa: E402

from bench.data import prepare_sample  # noqa: E402
from bench.report import write_document  # noqa: E402
from feeder.augment import CropRange, sample_crops  # noqa: E402
from feeder.launcher import DaemonProcess  # noqa: E402
from feeder.pipeline import AugmentKind, Job, PipelineRunner, PipelineSpec  # noqa: E402
from feeder.plan import LastBatch, epoch_order, iter_batches, rank_part  # noqa: E402
from protos import feeder_pb2, feeder_pb2_grpc  # noqa: E402
from shards.reader import ShardDataset, SplitIndex  # noqa: E402

__all__ = ["grpc_batches", "inprocess_batches", "main", "parse_args", "plot", "rate"]

_REPO = Path(__file__).resolve().parent.parent


def inprocess_batches(split: SplitIndex, args: argparse.Namespace) -> Generator[np.ndarray, None, None]:
    """Endless train batches decoded by DALI in this process, planned as the daemon does."""
    spec = PipelineSpec(AugmentKind.TRAIN, "cpu", args.batch_size, args.threads, args.prefetch)
    runner = PipelineRunner(spec, seed=args.seed)

    def jobs() -> Iterator[Job]:
        for epoch in count():
            part = rank_part(epoch_order(len(split), args.seed, epoch, True), 0, 1, LastBatch.DROP)
            for piece in iter_batches(part, 0, args.batch_size, LastBatch.DROP):
                rows = piece.indices
                crops = sample_crops(AugmentKind.TRAIN, args.seed, epoch, [split.keys[int(i)] for i in rows],
                                     split.widths[rows], split.heights[rows], CropRange())
                yield Job(split.read_many(rows), args.image_size, crops)

    yield from runner.run_many(jobs())


def _epoch_request(args: argparse.Namespace, epoch: int) -> feeder_pb2.StreamRequest:
    return feeder_pb2.StreamRequest(
        dataset="bench", split="train", seed=args.seed, epoch=epoch, world_size=1,
        batch_size=args.batch_size, image_size=args.image_size,
    )


def grpc_batches(stub: feeder_pb2_grpc.FeederStub, args: argparse.Namespace) -> Generator[np.ndarray, None, None]:
    """Endless train batches received from the daemon, as NHWC uint8 arrays: one
    stream of many epochs back to back (``StreamRequest.epochs``), as the in-process
    loop runs epoch after epoch without a pause."""
    request = feeder_pb2.StreamRequest(
        dataset="bench", split="train", seed=args.seed, epoch=0, epochs=1_000_000, world_size=1,
        batch_size=args.batch_size, image_size=args.image_size,
    )
    call = stub.StreamBatches(request)
    try:
        for batch in call:
            yield np.frombuffer(batch.images, dtype=np.uint8).reshape(tuple(batch.shape))
    finally:
        call.cancel()  # a consumer that stops early frees the daemon's stream


def rate(batches: Iterator[Sized], warmup_s: float, seconds: float) -> float:
    """Images/s over a window of at least ``seconds`` after ``warmup_s`` of warm-up."""
    start = time.monotonic()
    for batch in batches:
        if time.monotonic() - start >= warmup_s:
            break
    images, begin = 0, time.monotonic()
    for batch in batches:
        images += len(batch)
        elapsed = time.monotonic() - begin
        if elapsed >= seconds:
            return images / elapsed
    raise RuntimeError("loader ended early")


def plot(path: Path, results: dict[str, list[float]], ratio: float, title: str) -> None:
    """Bar per side at its median, each repeat as a dot, the ratio in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = ["dali_inprocess", "feeder_grpc"]
    fig, ax = plt.subplots(figsize=(6, 3))
    ax.barh(names, [statistics.median(results[n]) for n in names], color=["#999999", "#2a7ab0"])
    for y, name in enumerate(names):
        ax.plot(results[name], [y] * len(results[name]), "k.", markersize=4)
    ax.set_xlabel("images/s received (median of repeats; dots: repeats)")
    ax.set_title(f"{title}\nfeeder over gRPC / in-process DALI = {ratio:.2f}", fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--image-size", type=int, default=224, help="output side, px")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="DALI CPU threads, both sides")
    parser.add_argument("--prefetch", type=int, default=2, help="pipeline runs in flight, both sides")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=10.0, help="length of each measured window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here")
    parser.add_argument("--plot", type=Path, help="draw the two rates here (PNG)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shards = args.shards or prepare_sample(args.cache).shards
    split = ShardDataset.open("bench", shards).splits["train"]
    options = ("--device", "cpu", "--threads", str(args.threads), "--prefetch", str(args.prefetch))
    results: dict[str, list[float]] = {"feeder_grpc": [], "dali_inprocess": []}
    with DaemonProcess({"bench": shards}, options, cwd=_REPO) as daemon:
        channel_options = [("grpc.max_receive_message_length", -1)]
        with grpc.insecure_channel(daemon.address, options=channel_options) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            for repeat in range(args.repeats):
                for name, batches in (("dali_inprocess", inprocess_batches(split, args)), ("feeder_grpc", grpc_batches(stub, args))):
                    results[name].append(rate(batches, args.warmup_s, args.seconds))
                    batches.close()
                    print(f"repeat {repeat + 1}/{args.repeats} {name}: {results[name][-1]:.1f} images/s", flush=True)
    medians = {name: statistics.median(values) for name, values in results.items()}
    ratio = medians["feeder_grpc"] / medians["dali_inprocess"]
    print(f"feeder over gRPC {medians['feeder_grpc']:.1f} images/s, in-process DALI "
          f"{medians['dali_inprocess']:.1f} images/s: ratio {ratio:.3f} (target >= 0.85)")
    report = {
        "benchmark": "serve",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"shards": str(shards)},
        "samples": len(split),
        "images_per_s": results,
        "median_images_per_s": medians,
        "ratio_grpc_over_inprocess": ratio,
    }
    if args.plot:
        title = f"{len(split)} sample images, {args.image_size} px, CPU pipeline, {args.threads} DALI threads"
        plot(args.plot, results, ratio, title)
    if args.json:
        report = write_document(args.json, report)
    return report


if __name__ == "__main__":
    main()
