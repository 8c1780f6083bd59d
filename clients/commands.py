"""The ``train`` command: ``feeder train ...`` and ``python -m clients.train ...``
(under torchrun: ``torchrun --nproc-per-node N -m clients.train ...``)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer


__all__ = ["register", "train_command"]


def train_command(
    server: Annotated[str, typer.Option(help="Daemon address, e.g. 127.0.0.1:50051.")] = "",
    dataset: Annotated[str, typer.Option(help="Dataset name the daemon serves.")] = "imagenet",
    schedule: Annotated[str, typer.Option(
        help="Schedule TOML file or bundled name (imagenet-fastai, sample).")] = "imagenet-fastai",
    arch: Annotated[str, typer.Option(help="torchvision ResNet: resnet18 ... resnet152.")] = "resnet50",
    data: Annotated[str, typer.Option(
        help="feeder (stream from the daemon) or synthetic (random tensors, speed bound).")] = "feeder",
    precision: Annotated[str, typer.Option(
        help="auto (bf16 on a capable GPU, fp32 on CPU), fp32, bf16 or fp16 (loss scaling).")] = "auto",
    device: Annotated[str, typer.Option(help="auto, cpu or cuda.")] = "auto",
    train_split: Annotated[str, typer.Option(help="Split to train on.")] = "train",
    val_split: Annotated[str, typer.Option(help="Split to validate on.")] = "val",
    seed: Annotated[int, typer.Option(help="Seed of model init and shuffle plan.")] = 0,
    epochs: Annotated[int, typer.Option(help="Stop after N epochs (0: schedule length).")] = 0,
    val_every_epochs: Annotated[int, typer.Option(help="Validate every N epochs (0: never).")] = 1,
    target_top1: Annotated[float, typer.Option(
        help="Stop at this validation top-1 %, report time to it (e.g. 75).")] = 0.0,
    target_top5: Annotated[float, typer.Option(
        help="Stop at this validation top-5 %, report time to it (e.g. 93).")] = 0.0,
    out_dir: Annotated[Path, typer.Option(help="Where metrics.csv/png and summary.json go.")] = Path("runs/train"),
    checkpoint_dir: Annotated[Optional[Path], typer.Option(
        help="Checkpoint directory (default OUT_DIR/checkpoints).")] = None,
    checkpoint_every_steps: Annotated[int, typer.Option(
        help="Checkpoint every N optimizer steps, mid-epoch included (0: off).")] = 0,
    resume: Annotated[bool, typer.Option(help="Continue from the latest checkpoint.")] = False,
    visit_log: Annotated[Optional[Path], typer.Option(
        help="Directory for per-rank JSON {sample key: times trained on}.")] = None,
    exit_after_steps: Annotated[int, typer.Option(
        help="Stop abruptly after N steps without saving, like a crash (resume tests).")] = 0,
    max_steps_per_epoch: Annotated[int, typer.Option(help="Cut epochs after N steps (0: no).")] = 0,
    synthetic_samples: Annotated[int, typer.Option(
        help="Epoch length for synthetic data (0: the dataset's or ImageNet's).")] = 0,
    prefetch_batches: Annotated[int, typer.Option(help="Ready batches held per rank.")] = 4,
    reconnect_timeout_s: Annotated[float, typer.Option(
        help="Seconds to keep reconnecting to the daemon before failing.")] = 60.0,
    log_every_steps: Annotated[int, typer.Option(help="Progress line every N steps.")] = 50,
) -> None:
    """Train a ResNet on batches streamed by a feeder daemon (torch DDP, one process per GPU).

    Example: torchrun --nproc-per-node 8 -m clients.train --server 127.0.0.1:50051
    --dataset imagenet --schedule imagenet-fastai --target-top5 93
    """
    from clients.config import TrainConfig
    from clients.trainer import train
    from feeder.cli import run_command

    def run() -> None:
        config = TrainConfig(
            server=server, dataset=dataset, schedule=schedule, arch=arch, data=data,
            precision=precision, device=device, train_split=train_split, val_split=val_split,
            seed=seed, epochs=epochs, val_every_epochs=val_every_epochs,
            target_top1=target_top1, target_top5=target_top5, out_dir=out_dir,
            checkpoint_dir=checkpoint_dir, checkpoint_every_steps=checkpoint_every_steps,
            resume=resume, visit_log=visit_log, exit_after_steps=exit_after_steps,
            max_steps_per_epoch=max_steps_per_epoch, synthetic_samples=synthetic_samples,
            prefetch_batches=prefetch_batches, reconnect_timeout_s=reconnect_timeout_s,
            log_every_steps=log_every_steps,
        )
        train(config)

    run_command(run)


def register(app: typer.Typer) -> None:
    """Adds the ``train`` command to the ``feeder`` CLI."""
    app.command("train")(train_command)
