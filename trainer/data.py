"""The trainer's loaders: train and validation from the daemon, or synthetic tensors."""

from __future__ import annotations

import os
from typing import Any

import torch

from clients import FeederLoader, SyntheticLoader
from clients.channel import open_channel, resolve_token
from core.errors import ConfigError
from protos import feeder_pb2, feeder_pb2_grpc
from trainer.config import IMAGENET_TRAIN_SAMPLES, TrainConfig
from trainer.distributed import Dist
from trainer.schedule import Phase

__all__ = ["job_id", "make_loaders"]

IMAGENET_CLASSES = 1000


def job_id(config: TrainConfig) -> str:
    """What the ranks of this run tell the daemon they share: the dataset, the seed
    and torchrun's run id (its ``--rdzv-id``), so that two jobs of the same dataset and
    seed on one node's daemon are two jobs to its per-job limits."""
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    return f"train-{config.dataset}-{config.seed}" + (f"-{run}" if run and run != "none" else "")


def _describe_synthetic(config: TrainConfig) -> tuple[int, int]:
    """Epoch length and class count for synthetic data: the dataset's (a mix's: its
    datasets' together, the union of their classes) if a daemon is given, ImageNet's
    otherwise."""
    if not config.server:
        return config.synthetic_samples or IMAGENET_TRAIN_SAMPLES, IMAGENET_CLASSES
    first = config.server.split(",")[0].strip()  # a pool's daemons serve the same dataset
    with open_channel(first, (), resolve_token(None), config.tls_root) as channel:
        reply = feeder_pb2_grpc.FeederStub(channel).ListDatasets(
            feeder_pb2.ListDatasetsRequest(), timeout=30)
    train = config.train_dataset
    names = [train] if isinstance(train, str) else list(train)
    found = {info.name: info for info in reply.datasets if info.name in names}
    if len(found) < len(names):
        return config.synthetic_samples or IMAGENET_TRAIN_SAMPLES, IMAGENET_CLASSES
    samples = sum({s.name: s.num_samples for s in found[n].splits}.get(config.train_split, 1) for n in names)
    classes = {c for n in names for c in found[n].classes}
    return config.synthetic_samples or samples, len(classes)


def make_loaders(
    config: TrainConfig, dist: Dist, first: Phase, dtype: torch.dtype | None = None,
) -> tuple[FeederLoader | SyntheticLoader, FeederLoader | None, int]:
    """Builds ``(train loader, validation loader or None, number of classes)``.

    Images come normalised in ``dtype`` (the autocast dtype; None: fp32). The
    validation loader pads the last batch (every image once across ranks) and yields
    the padding mask so the pads can be left out of the metrics; as every pass is the
    same, it streams the next one while the model trains (see :func:`trainer.evaluate.evaluate`).
    """
    if config.data == "synthetic":
        samples, classes = _describe_synthetic(config)
        train = SyntheticLoader(samples, classes, first.batch_size, first.image_size,
                                world_size=dist.world_size, rank=dist.rank, device=dist.device,
                                seed=config.seed, dtype=dtype or torch.float32)
        return train, None, classes
    common: dict[str, Any] = dict(rank=dist.rank, world_size=dist.world_size, device=dist.device,
                  seed=config.seed, job_id=job_id(config), dtype=dtype or torch.float32,
                  channels_last=True,  # as the model is (trainer.model)
                  prefetch_batches=config.prefetch_batches,
                  reconnect_timeout_s=config.reconnect_timeout_s, tls_root=config.tls_root)
    train_loader = FeederLoader(
        config.train_dataset, address=config.server, split=config.train_split, batch_size=first.batch_size,
        image_size=first.image_size, last_batch="drop", return_keys=config.visit_log is not None, augment="train",
        min_scale=first.min_scale, max_batches_per_epoch=config.max_steps_per_epoch, **common)
    val_loader = None
    if config.val_every_epochs:
        val_loader = FeederLoader(
            config.validation_dataset, address=config.server, split=config.val_split, batch_size=first.batch_size,
            image_size=first.eval_image_size, last_batch="pad", return_padding=True, augment="val", **common)
    if val_loader is not None:
        _check_val_classes(val_loader, train_loader, config)
    return train_loader, val_loader, len(train_loader.classes)


def _check_val_classes(val: FeederLoader, train: FeederLoader, config: TrainConfig) -> None:
    """Refuse validation data whose labels mean other classes than the model's: a
    mix's model predicts the union of its datasets' classes, whose first are the
    first dataset's; a validation dataset must have those classes, in that order.

    Raises:
        ConfigError: naming the validation dataset (the loaders closed).
    """
    if list(val.classes) == list(train.classes[:len(val.classes)]):
        return
    val.close()
    train.close()
    raise ConfigError(f"--val-dataset {config.validation_dataset!r}: its {len(val.classes)} classes are not the first "
                      f"of the {len(train.classes)} the model learns from {config.dataset!r} (its labels would name "
                      "other classes); validate on a dataset with the classes of the first of the mix")
