"""Training schedules: phases of image size, batch size, learning rate and momentum.

A schedule is a TOML file (the format of ``trainer/schedules/*.toml``)::

    warmup_epochs = 2.0          # linear warm-up from 0 over the first 2 epochs
    weight_decay = 5e-5          # not applied to BN parameters and biases
    label_smoothing = 0.1
    lr_reference_batch = 256     # lr values are for this global batch; 0: no scaling

    [[phases]]
    epochs = 6                   # how many epochs this phase lasts
    image_size = 128             # pixels, square
    batch_size = 256             # per rank
    lr_start = 1.0               # linear from lr_start to lr_end across the phase
    lr_end = 2.0
    momentum = 0.9
    min_scale = 0.35             # RandomResizedCrop minimum area fraction (optional)
    val_image_size = 160         # optional, default image_size

Progressive resizing and batch-size schedules (fast.ai, ModelArts DAWNBench runs) are
phases with different ``image_size`` / ``batch_size``; the loader follows them
without restarting the daemon.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from core.errors import ConfigError

__all__ = ["Phase", "Schedule", "bundled_schedules", "load_schedule"]

_PHASE_KEYS = {
    "epochs", "image_size", "batch_size", "lr_start", "lr_end", "momentum",
    "min_scale", "val_image_size",
}
_TOP_KEYS = {"warmup_epochs", "weight_decay", "label_smoothing", "lr_reference_batch", "phases",
             "description"}


@dataclass(frozen=True)
class Phase:
    """One stretch of training with fixed sizes and a linear lr ramp.

    Attributes:
        epochs: Length of the phase in epochs (>= 1).
        image_size: Training image side in pixels.
        batch_size: Batch size per rank.
        lr_start: Learning rate at the start of the phase (before batch scaling).
        lr_end: Learning rate at the end of the phase.
        momentum: SGD momentum.
        min_scale: RandomResizedCrop minimum area fraction (0: daemon default 0.08).
        val_image_size: Validation image side in pixels (0: same as ``image_size``).
    """

    epochs: int
    image_size: int
    batch_size: int
    lr_start: float
    lr_end: float
    momentum: float = 0.9
    min_scale: float = 0.0
    val_image_size: int = 0

    def __post_init__(self) -> None:
        for name in ("epochs", "image_size", "batch_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"phase {name} must be >= 1, got {getattr(self, name)}")
        if self.lr_start < 0 or self.lr_end < 0:
            raise ConfigError("phase lr_start and lr_end must be >= 0")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"phase momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.min_scale <= 1:
            raise ConfigError(f"phase min_scale must be in [0, 1], got {self.min_scale}")
        if self.val_image_size < 0:
            raise ConfigError("phase val_image_size must be >= 0")

    @property
    def eval_image_size(self) -> int:
        """Validation image side in pixels."""
        return self.val_image_size or self.image_size


@dataclass(frozen=True)
class Schedule:
    """Phases run one after another, plus the recipe-wide settings.

    Attributes:
        phases: The phases, in order.
        warmup_epochs: Linear warm-up length in epochs (multiplies the phase lr).
        weight_decay: L2 penalty on weights (never on BN parameters or biases).
        label_smoothing: Cross-entropy label smoothing.
        lr_reference_batch: Global batch the lr values are given for; the lr is
            scaled by ``global_batch / lr_reference_batch`` (0: no scaling).
    """

    phases: tuple[Phase, ...]
    warmup_epochs: float = 0.0
    weight_decay: float = 5e-5
    label_smoothing: float = 0.1
    lr_reference_batch: int = 0

    def __post_init__(self) -> None:
        if not self.phases:
            raise ConfigError("a schedule needs at least one phase")
        if self.warmup_epochs < 0 or self.weight_decay < 0 or self.lr_reference_batch < 0:
            raise ConfigError("warmup_epochs, weight_decay, lr_reference_batch must be >= 0")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")

    @property
    def total_epochs(self) -> int:
        """Sum of the phase lengths."""
        return sum(p.epochs for p in self.phases)

    def phase_starts(self) -> list[tuple[int, Phase]]:
        """(first epoch, phase) of every phase, in order."""
        starts, epoch = [], 0
        for phase in self.phases:
            starts.append((epoch, phase))
            epoch += phase.epochs
        return starts

    def phase_index(self, epoch: int) -> int:
        """Index of the phase that epoch ``epoch`` (0-based) belongs to."""
        end = 0
        for i, phase in enumerate(self.phases):
            end += phase.epochs
            if epoch < end:
                return i
        return len(self.phases) - 1

    def phase_at(self, epoch: int) -> Phase:
        """The phase epoch ``epoch`` (0-based) belongs to."""
        return self.phases[self.phase_index(epoch)]

    def lr_at(self, position: float, world_size: int = 1) -> float:
        """Learning rate at ``position`` epochs into training (fractional).

        Args:
            position: Epochs done, e.g. 3.25 = a quarter into the 4th epoch.
            world_size: Ranks, for scaling with the global batch.

        Returns:
            The lr: phase ramp x warm-up factor x batch scaling.
        """
        index = self.phase_index(int(position))
        phase = self.phases[index]
        start = sum(p.epochs for p in self.phases[:index])
        fraction = min(max((position - start) / phase.epochs, 0.0), 1.0)
        lr = phase.lr_start + (phase.lr_end - phase.lr_start) * fraction
        if self.warmup_epochs > 0:
            lr *= min(1.0, position / self.warmup_epochs)
        if self.lr_reference_batch:
            lr *= phase.batch_size * world_size / self.lr_reference_batch
        return lr


def _parse(data: dict[str, Any], source: str) -> Schedule:
    unknown = set(data) - _TOP_KEYS
    if unknown:
        raise ConfigError(f"{source}: unknown schedule keys {sorted(unknown)}")
    phases = []
    for i, raw in enumerate(data.get("phases", [])):
        bad = set(raw) - _PHASE_KEYS
        if bad:
            raise ConfigError(f"{source}: phase {i}: unknown keys {sorted(bad)}")
        try:
            phases.append(Phase(**raw))
        except TypeError as e:
            raise ConfigError(f"{source}: phase {i}: {e}") from e
        except ConfigError as e:
            raise ConfigError(f"{source}: phase {i}: {e}") from e
    settings = {k: v for k, v in data.items() if k not in ("phases", "description")}
    try:
        return Schedule(phases=tuple(phases), **settings)
    except ConfigError as e:
        raise ConfigError(f"{source}: {e}") from e


def bundled_schedules() -> list[str]:
    """Names of the schedules shipped in ``trainer/schedules``."""
    folder = resources.files("trainer") / "schedules"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".toml"))


def load_schedule(name_or_path: str) -> Schedule:
    """Reads a schedule from a TOML file, or a bundled one by name.

    Args:
        name_or_path: A path to a ``.toml`` file, or the name of a bundled schedule
            (``imagenet-fastai``, ``sample``).

    Returns:
        The parsed, checked schedule.

    Raises:
        ConfigError: neither a file nor a bundled name matches, the file is not valid
            TOML, or a value is out of range (the message names the file and phase).
    """
    path = Path(name_or_path)
    if path.is_file():
        text, source = path.read_text(), str(path)
    elif name_or_path in bundled_schedules():
        resource = resources.files("trainer") / "schedules" / f"{name_or_path}.toml"
        text, source = resource.read_text(), f"schedule {name_or_path!r}"
    else:
        raise ConfigError(
            f"schedule {name_or_path!r} is neither a file nor one of {bundled_schedules()}"
        )
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{source}: not valid TOML: {e}") from e
    return _parse(data, source)
