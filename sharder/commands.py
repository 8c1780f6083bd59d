"""The sharder's commands: ``feeder sample-data``, ``feeder shard``, ``feeder verify``.
Their options are the fields of :class:`sharder.config.SampleDataConfig`,
:class:`~sharder.config.ShardConfig` and :class:`~sharder.config.VerifyConfig`,
written once there. The work is imported when a command runs: ``feeder --help``
starts without Pillow or OpenCV."""

from __future__ import annotations

import sys

import typer

from core.options import command_from_config
from sharder.config import SampleDataConfig, ShardConfig, VerifyConfig

__all__ = ["register", "sample_data_command", "shard_command", "verify_command"]


def _sample_data(config: SampleDataConfig) -> None:
    from sharder.sample_data import make_sample_data

    make_sample_data(config)
    train, val = config.classes * config.train_per_class, config.classes * config.val_per_class
    print(f"wrote {train + val} images of {config.classes} classes ({train} train, {val} val) -> {config.out}")


def _shard(config: ShardConfig) -> None:
    from sharder.shard import shard
    from sharder.upload import shard_to_store

    try:
        print((shard_to_store(config) if config.upload_to else shard(config)).summary())
    except KeyboardInterrupt:
        print(f"feeder: interrupted; run the same command again to resume into {config.upload_to or config.out}",
              file=sys.stderr)
        raise typer.Exit(130) from None


def _verify(config: VerifyConfig) -> None:
    from sharder.verify import verify

    result = verify(config)
    for problem in result.problems:
        print(f"problem: {problem}")
    print(result.summary())
    if result.problems:
        raise typer.Exit(1)


sample_data_command = command_from_config(
    SampleDataConfig,
    _sample_data,
    doc=(
        "Make a small real-photo ImageNet in the ILSVRC2012 layout.\n\n"
        "Example: feeder sample-data data/sample --classes 10 --train-per-class 100"
    ),
)

shard_command = command_from_config(
    ShardConfig,
    _shard,
    doc=(
        "Shard an image folder tree into WebDataset tars (+ DALI .idx), an index and a manifest.\n\n"
        "Example: feeder shard ~/ILSVRC/Data/CLS-LOC out/imagenet --formats wds,lmdb --workers 8\n\n"
        "Into an object store: feeder shard ~/ILSVRC/Data/CLS-LOC s3://bucket/imagenet --workers 8"
    ),
)

verify_command = command_from_config(
    VerifyConfig,
    _verify,
    doc=(
        "Check a shard directory: manifest, sha256, counts, index offsets, decodable images.\n\n"
        "Example: feeder verify out/imagenet --full\n\n"
        "In an object store: feeder verify s3://bucket/imagenet"
    ),
)


def register(app: typer.Typer) -> None:
    """Attach the sharder's commands to the ``feeder`` CLI."""
    app.command("sample-data")(sample_data_command)
    app.command("shard")(shard_command)
    app.command("verify")(verify_command)
