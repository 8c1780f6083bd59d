"""``TrainConfig``: everything one training run needs, built once by the CLI."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

from clients.channel import ADDRESS_ENV
from core.errors import ConfigError

__all__ = ["ARCHS", "DATA_SOURCES", "PRECISIONS", "STEP_PRIORITIES", "TrainConfig", "parse_mix"]

ARCHS = ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152")
DATA_SOURCES = ("feeder", "synthetic")
PRECISIONS = ("auto", "fp32", "bf16", "fp16")
STEP_PRIORITIES = ("high", "normal")
IMAGENET_TRAIN_SAMPLES = 1_281_167


def parse_mix(text: str) -> str | dict[str, float]:
    """``--dataset``: a name, or a mix ``NAME=WEIGHT,NAME=WEIGHT,...`` as a mapping of
    names to weights in the order given.

    Raises:
        ConfigError: an entry without a weight, a weight that is not a positive finite
            number, a name given twice (one line naming it).
    """
    if "=" not in text and "," not in text:
        return text
    mix: dict[str, float] = {}
    for entry in text.split(","):
        name, sep, weight = (part.strip() for part in entry.partition("="))
        if not sep or not name:
            raise ConfigError(f"--dataset {text!r}: {entry.strip()!r} is not NAME=WEIGHT")
        if name in mix:
            raise ConfigError(f"--dataset {text!r}: {name!r} given twice")
        try:
            value = float(weight)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and value > 0):
            raise ConfigError(f"--dataset {text!r}: the weight of {name!r} is {weight!r}, not a positive finite "
                              "number")
        mix[name] = value
    return mix


@dataclass(frozen=True)
class TrainConfig:
    """One training run.

    Args:
        server: ``host:port`` of the feeder daemon, or ``unix:/path`` of its socket,
            or several ``host:port`` separated by commas: a pool of daemons
            (optional with synthetic data); empty: the ``FEEDER_ADDRESS`` environment
            variable, which ``feeder run`` sets. A daemon with a token reads it from
            the ``FEEDER_TOKEN`` environment variable.
        tls_root: PEM file of the CA that signed the daemon's TLS certificate (None:
            plaintext).
        dataset: Dataset name the daemon serves, or a mix of several with their
            weights, ``NAME=WEIGHT,NAME=WEIGHT`` (``imagenet=0.8,extra=0.2``): each
            gives its weight's share of every epoch and batch, labels over the union of
            their class names.
        val_dataset: Dataset to validate on (empty: ``dataset``, or a mix's first).
        schedule: Path of a schedule TOML file, or a bundled schedule's name.
        arch: torchvision ResNet name.
        data: ``feeder`` (stream from the daemon) or ``synthetic`` (random tensors made
            on the device: the trainer's speed upper bound).
        precision: ``auto`` (bf16 autocast on a GPU that supports it, fp32 otherwise),
            ``fp32``, ``bf16`` or ``fp16`` (with dynamic loss scaling).
        device: ``auto`` (CUDA when available), ``cpu`` or ``cuda``.
        train_split: Split to train on.
        val_split: Split to validate on (every image once, padding excluded).
        seed: Seed of the model init and of the daemon's shuffle plan.
        epochs: Stop after this many epochs (0: the schedule's length).
        val_every_epochs: Validate every N epochs (and after the last); 0: never.
        target_top1: Stop once validation top-1 reaches this percentage (0: no target).
        target_top5: Stop once validation top-5 reaches this percentage (0: no target).
        out_dir: Where the CSV log, the PNG plot and summary.json go.
        checkpoint_dir: Where checkpoints go (None: ``out_dir/checkpoints``).
        checkpoint_every_steps: Checkpoint every N optimizer steps (0: at epoch ends only).
        resume: Continue from the latest checkpoint if there is one.
        visit_log: Directory for per-rank ``{key: times trained on}`` JSON files.
        max_steps_per_epoch: Cut epochs short after N steps (benchmarks); 0: no limit.
        synthetic_samples: Epoch length with synthetic data (0: the dataset's, or
            ImageNet's 1,281,167 without a daemon).
        prefetch_batches: Ready batches the loader holds per rank.
        reconnect_timeout_s: How long the loader keeps reconnecting to the daemon.
        log_every_steps: Progress line every N steps on rank 0 (0: none); the only
            place the loss is read back during an epoch (a host synchronisation).
        step_priority: ``high``: on CUDA, the steps run on a stream of the highest
            priority (the input pipeline's GPU work, at the lowest, goes after
            theirs); ``normal``: on the default stream.
    """

    server: str = ""
    tls_root: Path | None = None
    dataset: str = "imagenet"
    val_dataset: str = ""
    schedule: str = "imagenet-fastai"
    arch: str = "resnet50"
    data: str = "feeder"
    precision: str = "auto"
    device: str = "auto"
    train_split: str = "train"
    val_split: str = "val"
    seed: int = 0
    epochs: int = 0
    val_every_epochs: int = 1
    target_top1: float = 0.0
    target_top5: float = 0.0
    out_dir: Path = Path("runs/train")
    checkpoint_dir: Path | None = None
    checkpoint_every_steps: int = 0
    resume: bool = False
    visit_log: Path | None = None
    max_steps_per_epoch: int = 0
    synthetic_samples: int = 0
    prefetch_batches: int = 4
    reconnect_timeout_s: float = 60.0
    log_every_steps: int = 50
    step_priority: str = "high"

    def __post_init__(self) -> None:
        parse_mix(self.dataset)
        if self.data not in DATA_SOURCES:
            raise ConfigError(f"--data {self.data!r}: choose one of {', '.join(DATA_SOURCES)}")
        if self.data == "feeder" and not self.server:
            object.__setattr__(self, "server", os.environ.get(ADDRESS_ENV, "").strip())
        if self.data == "feeder" and not self.server:
            raise ConfigError(f"--server HOST:PORT (or {ADDRESS_ENV}, which feeder run sets) is needed to train on "
                              "feeder data")
        if self.data == "synthetic" and self.visit_log is not None:
            raise ConfigError("--visit-log needs feeder data (synthetic batches have no keys)")
        if self.precision not in PRECISIONS:
            raise ConfigError(f"--precision {self.precision!r}: choose one of "
                              f"{', '.join(PRECISIONS)}")
        if self.device not in ("auto", "cpu", "cuda"):
            raise ConfigError(f"--device {self.device!r}: choose auto, cpu or cuda")
        if self.step_priority not in STEP_PRIORITIES:
            raise ConfigError(f"--step-priority {self.step_priority!r}: choose one of {', '.join(STEP_PRIORITIES)}")
        if self.arch not in ARCHS:
            raise ConfigError(f"--arch {self.arch!r}: choose one of {', '.join(ARCHS)}")
        for name in ("epochs", "val_every_epochs", "checkpoint_every_steps",
                     "max_steps_per_epoch", "synthetic_samples", "log_every_steps"):
            if getattr(self, name) < 0:
                raise ConfigError(f"--{name.replace('_', '-')} must be >= 0")
        for name in ("target_top1", "target_top5"):
            if not 0 <= getattr(self, name) <= 100:
                raise ConfigError(f"--{name.replace('_', '-')} is a percentage (0-100)")
        if self.prefetch_batches < 1 or self.reconnect_timeout_s <= 0:
            raise ConfigError("--prefetch-batches and --reconnect-timeout-s must be positive")

    @property
    def train_dataset(self) -> str | dict[str, float]:
        """What the train loader streams: a name, or a mix's names and weights."""
        return parse_mix(self.dataset)

    @property
    def validation_dataset(self) -> str:
        """What the validation loader streams: ``val_dataset``, else the (first) dataset."""
        train = self.train_dataset
        return self.val_dataset or (train if isinstance(train, str) else next(iter(train)))

    @property
    def checkpoints(self) -> Path:
        """The checkpoint directory."""
        return self.checkpoint_dir or self.out_dir / "checkpoints"

    @property
    def has_target(self) -> bool:
        """True when a time-to-accuracy target is set."""
        return self.target_top1 > 0 or self.target_top5 > 0
