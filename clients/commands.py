"""The ``train`` command: ``feeder train ...`` and ``python -m clients.train ...``
(under torchrun: ``torchrun --nproc-per-node N -m clients.train ...``). Its options
are the fields of :class:`clients.config.TrainConfig`, written once there."""

from __future__ import annotations

import typer

from clients.config import TrainConfig
from core.options import command_from_config

__all__ = ["register", "train_command"]


def _train(config: TrainConfig) -> None:
    from clients.stop import Stopped
    from clients.trainer import train  # torch is imported only when a run starts

    try:
        train(config)
    except Stopped as e:  # checkpointed: --resume goes on from there
        raise typer.Exit(128 + e.signum) from e


train_command = command_from_config(
    TrainConfig,
    _train,
    doc=(
        "Train a ResNet on batches streamed by a feeder daemon (torch DDP, one process per GPU).\n\n"
        "Example: torchrun --nproc-per-node 8 -m clients.train --server 127.0.0.1:50051 "
        "--dataset imagenet --schedule imagenet-fastai --target-top5 93"
    ),
)


def register(app: typer.Typer) -> None:
    """Adds the ``train`` command to the ``feeder`` CLI."""
    app.command("train")(train_command)
