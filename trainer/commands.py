"""The ``train`` command: ``feeder train ...`` and ``python -m trainer.train ...``
(under torchrun: ``torchrun --nproc-per-node N -m trainer.train ...``). Its options
are the fields of :class:`trainer.config.TrainConfig`, written once there."""

from __future__ import annotations

from importlib.util import find_spec

import typer

from core.errors import ConfigError
from core.options import command_from_config
from trainer.config import TrainConfig

__all__ = ["EXTRA_MODULES", "check_extra_installed", "register", "train_command"]


# What the trainer needs beyond the loader: the extra ``feeder[trainer]``.
EXTRA_MODULES = ("torchvision", "matplotlib")


def check_extra_installed() -> None:
    """Raises ConfigError, before anything starts, where the trainer's extra is missing
    (the plot at the end of a run would fail only after the training)."""
    missing = [name for name in EXTRA_MODULES if find_spec(name) is None]
    if missing:
        raise ConfigError(f"the trainer needs {' and '.join(missing)}: pip install 'feeder[trainer]'")


def _train(config: TrainConfig) -> None:
    check_extra_installed()
    from trainer.loop import train  # torch is imported only when a run starts
    from trainer.stop import Stopped

    try:
        train(config)
    except Stopped as e:  # checkpointed: --resume goes on from there
        raise typer.Exit(128 + e.signum) from e


train_command = command_from_config(
    TrainConfig,
    _train,
    doc=(
        "Train a ResNet on batches streamed by a feeder daemon (torch DDP, one process per GPU).\n\n"
        "Example: torchrun --nproc-per-node 8 -m trainer.train --server 127.0.0.1:50051 "
        "--dataset imagenet --schedule imagenet-fastai --target-top5 93"
    ),
)


def register(app: typer.Typer) -> None:
    """Adds the ``train`` command to the ``feeder`` CLI."""
    app.command("train")(train_command)
