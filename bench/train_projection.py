"""The time a schedule would take on a node of GPUs, from the trainer's measured rates.

A schedule's phases train at a few image sizes; each epoch of ImageNet takes
1,281,167 images over the node's GPUs at the per-GPU rate measured at its size. A
size not measured is scaled from the nearest measured one by pixel count (a ResNet's
work per image grows with it), and said so. Validation is left out, as in the
figures it is compared with (fast.ai's and MLPerf's training time).
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer.config import IMAGENET_TRAIN_SAMPLES
from trainer.schedule import load_schedule

__all__ = ["PhaseTime", "Projection", "project"]


@dataclass(frozen=True)
class PhaseTime:
    """One phase of the schedule as projected.

    Attributes:
        image_size: its training side, px.
        epochs: its epochs.
        images_per_s_per_gpu: the rate used.
        measured_at: the size that rate was measured at (``image_size`` itself, or
            the nearest measured one it was scaled from).
        seconds: its training time.
    """

    image_size: int
    epochs: int
    images_per_s_per_gpu: float
    measured_at: int
    seconds: float


@dataclass(frozen=True)
class Projection:
    """A schedule's projected training time on ``gpus`` GPUs."""

    schedule: str
    gpus: int
    phases: tuple[PhaseTime, ...]

    @property
    def minutes(self) -> float:
        return sum(p.seconds for p in self.phases) / 60

    def line(self) -> str:
        """One line: the total and, per image size, its epochs, rate and minutes."""
        sizes: dict[int, list[PhaseTime]] = {}
        for phase in self.phases:
            sizes.setdefault(phase.image_size, []).append(phase)
        parts = []
        for size, phases in sizes.items():
            first = phases[0]
            scaled = "" if first.measured_at == size else f", scaled from {first.measured_at} px"
            parts.append(f"{sum(p.epochs for p in phases)} epochs at {size} px, {first.images_per_s_per_gpu:,.0f} "
                         f"img/s per GPU{scaled}: {sum(p.seconds for p in phases) / 60:.1f} min")
        return f"projected {self.schedule} on {self.gpus} GPUs: {self.minutes:.1f} min ({'; '.join(parts)})"


def project(rates_per_gpu: dict[int, float], schedule: str = "imagenet-fastai", gpus: int = 8,
            samples: int = IMAGENET_TRAIN_SAMPLES) -> Projection:
    """``schedule``'s training time at ``rates_per_gpu`` (image side -> images/s per GPU).

    Raises:
        ValueError: no rate given, or one that is not positive.
    """
    if not rates_per_gpu or min(rates_per_gpu.values()) <= 0:
        raise ValueError(f"rates per GPU must be positive, got {rates_per_gpu}")
    phases = []
    for phase in load_schedule(schedule).phases:
        measured_at = min(rates_per_gpu, key=lambda size: (abs(size - phase.image_size), size))
        rate = rates_per_gpu[measured_at] * (measured_at / phase.image_size) ** 2
        phases.append(PhaseTime(phase.image_size, phase.epochs, rate, measured_at,
                                phase.epochs * samples / (gpus * rate)))
    return Projection(schedule, gpus, tuple(phases))
