"""``make demo``: the main job end to end on the embedded sample data.

Runs the same commands a user would, each in its own process:

1. ``feeder sample-data``  — a small ILSVRC-shaped tree of real photographs;
2. ``feeder shard``        — WebDataset + LMDB shards, Parquet index, manifest, and
   half-scale copies (the sample schedule's 32 and 48 px phases decode from them);
3. ``feeder verify``       — checks the shards against the manifest;
4. ``feeder serve``        — the daemon, on a free port;
5. one epoch streamed through ``FeederLoader``, checked for exactly-once delivery;
6. ``torchrun --nproc-per-node 2 -m trainer.train`` — two DDP ranks trained through
   the daemon, printing accuracy and the data-stall fraction;
7. SIGTERM to the daemon, which must exit 0.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from launcher.daemon_process import DaemonProcess

__all__ = ["DemoConfig", "main", "run_demo"]

DATASET = "sample"


@dataclass(frozen=True)
class DemoConfig:
    """Where the demo writes and how big it is.

    Args:
        workdir: folder for the sample data, shards and training outputs.
        train_per_class: training images per class of the sample data.
        val_per_class: validation images per class.
        stream_image_size: pixels of the epoch streamed in step 5.
        ranks: DDP processes of the training step.
        startup_timeout_s: seconds the daemon may take to print its address.
    """

    workdir: Path
    train_per_class: int = 60
    val_per_class: int = 10
    stream_image_size: int = 224
    ranks: int = 2
    startup_timeout_s: float = 120.0


def _step(title: str) -> None:
    print(f"\n== {title}", flush=True)


def _feeder(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "feeder", *args], check=True)


def _make_shards(config: DemoConfig) -> Path:
    src, shards = config.workdir / "src", config.workdir / "shards"
    _step(f"feeder sample-data {src}")
    if not (src / "train").is_dir():
        _feeder("sample-data", str(src), "--train-per-class", str(config.train_per_class),
                "--val-per-class", str(config.val_per_class))
    else:
        print(f"{src} exists; reusing it")
    _step(f"feeder shard {src} {shards}")
    _feeder("shard", str(src), str(shards), "--formats", "wds,lmdb", "--workers", "2", "--half-copies", "--overwrite")
    _step(f"feeder verify {shards}")
    _feeder("verify", str(shards))
    return shards


def _start_daemon(shards: Path, timeout_s: float) -> DaemonProcess:
    daemon = DaemonProcess({DATASET: shards}, start_timeout_s=timeout_s, stop_timeout_s=60,
                           echo=lambda line: print(f"  [daemon] {line}", end="", flush=True))
    _step(" ".join(["feeder", *daemon.command[3:]]))
    try:
        daemon.start()
    except RuntimeError as e:
        raise SystemExit(f"feeder demo: {e}") from e
    return daemon


def _stream_epoch(address: str, shards: Path, image_size: int) -> None:
    from clients import FeederLoader

    _step(f"one epoch of '{DATASET}/train' at {image_size} px through FeederLoader")
    from shards.manifest import read_manifest

    expected = read_manifest(shards).splits["train"].num_samples
    loader = FeederLoader(DATASET, address=address, split="train", batch_size=32, image_size=image_size,
                          rank=0, world_size=1, device="cpu", normalize=False,
                          last_batch="pad", return_keys=True, return_padding=True)
    seen: Counter[str] = Counter()
    shape: tuple[int, ...] = ()
    start = time.perf_counter()
    with loader:  # closes the stream and channel before the daemon is stopped
        for images, _labels, keys, padding in loader:
            seen.update(k for k, pad in zip(keys, padding.tolist()) if not pad)
            shape = tuple(images.shape)
    elapsed = time.perf_counter() - start
    once = len(seen) == expected and set(seen.values()) == {1}
    print(f"{sum(seen.values())} images in {elapsed:.1f} s ({sum(seen.values()) / elapsed:.0f} images/s), "
          f"batches of {shape}, every sample exactly once: {once}")
    if not once:
        raise SystemExit("feeder demo: the streamed epoch did not hold every sample exactly once")


def _train(address: str, config: DemoConfig) -> None:
    out = config.workdir / "train"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc-per-node={config.ranks}", "-m", "trainer.train",
           "--server", address, "--dataset", DATASET, "--schedule", "sample",
           "--arch", "resnet18", "--target-top1", "80", "--out-dir", str(out),
           "--log-every-steps", "1000"]
    _step(f"torchrun --nproc-per-node {config.ranks} -m trainer.train --schedule sample")
    subprocess.run(cmd, check=True)
    summary = json.loads((out / "summary.json").read_text())
    print(f"demo training: val top-1 {summary['val_top1']:.1%}, top-5 {summary['val_top5']:.1%}, "
          f"data-stall fraction {summary['stall_fraction']:.1%}; plot {out / 'metrics.png'}")


def _stop_daemon(daemon: DaemonProcess) -> None:
    _step("SIGTERM to the daemon")
    code = daemon.stop()
    print(f"daemon exited with status {code}")
    if code != 0:
        raise SystemExit(f"feeder demo: the daemon exited with status {code} on SIGTERM")


def run_demo(config: DemoConfig) -> None:
    """Run every step; raise SystemExit naming the step that failed."""
    config.workdir.mkdir(parents=True, exist_ok=True)
    shards = _make_shards(config)
    daemon = _start_daemon(shards, config.startup_timeout_s)
    try:
        _stream_epoch(daemon.address, shards, config.stream_image_size)
        _train(daemon.address, config)
    finally:
        _stop_daemon(daemon)
    print("\nfeeder demo: done")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path(".demo"), help="Output folder.")
    args = parser.parse_args(argv)
    try:
        run_demo(DemoConfig(workdir=args.workdir))
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"feeder demo: {' '.join(map(str, e.cmd[:5]))} ... exited with status {e.returncode}") from e


if __name__ == "__main__":
    main()
