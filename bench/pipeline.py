"""The daemon's pipeline alone: images/s of ``decode.runner.PipelineRunner`` on shard
bytes in this process, with no stream, queue or transport around it: the ceiling of
everything above it (``bench/throughput.py``'s in-process loader and the daemon).
It also reports the pipeline's CPU time per image (every thread of this process) and
what checking a sample's bytes against its checksum in the index costs of it (xxh3_64
over every train sample, timed alone: each read of the daemon does it once).

Reads, crop windows and the plan are the daemon's (``shards.reader``,
``decode.augment``, ``protocol.plan``). On the GPU each batch is written device to
device into one of a few CUDA buffers, as into a CUDA IPC slot; on the CPU into host
memory. After a warm-up, the median of ``--repeats`` windows is reported.

Example::

    python bench/pipeline.py --device gpu --image-size 224 --batch-size 128 --json out/pipeline.json
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
import time
from collections.abc import Iterator
from pathlib import Path

if not __package__:  # run as a script: make the repository importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.data import prepare_sample  # noqa: E402
from bench.report import write_document  # noqa: E402
from decode.augment import Crops, sample_crops  # noqa: E402
from decode.jobs import Allocate, Decoded, Job, Outcome  # noqa: E402
from decode.pipeline import PipelineSpec  # noqa: E402
from decode.runner import PipelineRunner  # noqa: E402
from protocol.plan import LastBatch, epoch_order, iter_batches, rank_part  # noqa: E402
from protocol.request import AugmentKind, CropRange  # noqa: E402
from shards.layout import sample_checksum  # noqa: E402
from shards.reader import ShardDataset, SplitIndex  # noqa: E402
from transport.base import Slot, host_slot  # noqa: E402

__all__ = ["main", "parse_args"]

_REPO = Path(__file__).resolve().parent.parent
_DEVICE_BUFFERS = 4  # CUDA buffers written in turn, as a stream's ring of slots


def _jobs(split: SplitIndex, args: argparse.Namespace) -> Iterator[Job]:
    """Endless train batches of the daemon's plan, epoch after epoch."""
    for epoch in itertools.count():
        part = rank_part(epoch_order(len(split), args.seed, epoch, True), 0, 1, LastBatch.DROP)
        for piece in iter_batches(part, 0, args.batch_size, LastBatch.DROP):
            rows = piece.indices
            crops = sample_crops(AugmentKind.TRAIN, args.seed, epoch, [split.keys[int(i)] for i in rows],
                                 split.widths[rows], split.heights[rows], CropRange())
            jpegs, boxes, _ = split.read_windows(rows, crops.boxes, args.image_size)  # as the daemon reads
            yield Job(jpegs, args.image_size, Crops(boxes=boxes, flips=crops.flips))


def rate(batches: Iterator[Outcome[Job]], warmup_s: float, seconds: float) -> tuple[float, float]:
    """Images/s and CPU ms per image (this process, all threads) over a window of at
    least ``seconds`` (whole batches) after ``warmup_s`` of batches discarded."""
    start = time.monotonic()
    for _ in batches:
        if time.monotonic() - start >= warmup_s:
            break
    images, begin, cpu = 0, time.monotonic(), time.process_time()
    for outcome in batches:
        if not isinstance(outcome, Decoded):
            raise outcome.error
        images += len(outcome.job)
        elapsed = time.monotonic() - begin
        if elapsed >= seconds:
            return images / elapsed, (time.process_time() - cpu) * 1e3 / images
    raise RuntimeError("pipeline ended early")


def checksum_us(split: SplitIndex, passes: int = 5) -> float:
    """CPU us per image of ``sample_checksum`` over every sample's stored bytes, the
    median of ``passes`` passes."""
    data = [split.read(i) for i in range(len(split))]
    times = []
    for _ in range(passes):
        started = time.process_time()
        for sample in data:
            sample_checksum(sample)
        times.append((time.process_time() - started) * 1e6 / len(data))
    return statistics.median(times)


def _device_buffers(args: argparse.Namespace) -> Allocate:
    import torch

    shape = (args.batch_size, args.image_size, args.image_size, 3)
    buffers = itertools.cycle([torch.empty(shape, dtype=torch.uint8, device="cuda:0")
                               for _ in range(_DEVICE_BUFFERS)])
    return lambda wanted: Slot(pixels=next(buffers)[: wanted[0]])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shards", type=Path, help="shard directory (default: the sample data)")
    parser.add_argument("--cache", type=Path, default=_REPO / ".bench", help="where sample data is made")
    parser.add_argument("--device", choices=("cpu", "gpu"), default="cpu", help="gpu: decode on CUDA device 0")
    parser.add_argument("--image-size", type=int, default=224, help="output side, px")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2, help="DALI CPU threads")
    parser.add_argument("--prefetch", type=int, default=2, help="pipeline runs in flight")
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--seconds", type=float, default=5.0, help="length of each measured window")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write results here")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    shards = args.shards or prepare_sample(args.cache).shards
    split = ShardDataset.open("bench", shards).splits["train"]
    spec = PipelineSpec(device=args.device, max_batch_size=args.batch_size, threads=args.threads,
                        prefetch=args.prefetch)
    runner = PipelineRunner(spec)
    allocate = _device_buffers(args) if args.device == "gpu" else host_slot
    batches = runner.run_many(_jobs(split, args), allocate)
    rates, cpu_ms = [], []
    for repeat in range(args.repeats):
        images_per_s, ms = rate(batches, args.warmup_s if repeat == 0 else 0.0, args.seconds)
        rates.append(images_per_s)
        cpu_ms.append(ms)
        print(f"repeat {repeat + 1}/{args.repeats}: {images_per_s:.1f} images/s, {ms:.3f} CPU ms per image", flush=True)
    runner.close()
    median, check_us = statistics.median(rates), checksum_us(split)
    share = check_us / (statistics.median(cpu_ms) * 1e3)
    print(f"pipeline alone, {args.device}, {args.image_size} px, batch {args.batch_size}: {median:.1f} images/s "
          f"(device-to-device copies {runner.device_copies}, host copies {runner.host_copies}); "
          f"{statistics.median(cpu_ms):.3f} CPU ms per image, of which the checksum {check_us:.1f} us ({share:.2%})")
    report = {
        "benchmark": "pipeline",
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()} | {"shards": str(shards)},
        "samples": len(split),
        "images_per_s": rates,
        "median_images_per_s": median,
        "cpu_ms_per_image": cpu_ms,
        "checksum_us_per_image": check_us,
        "checksum_share_of_cpu": share,
        "host_copies": runner.host_copies,
        "device_copies": runner.device_copies,
    }
    if args.json:
        report = write_document(args.json, report)
    return report


if __name__ == "__main__":
    main()
