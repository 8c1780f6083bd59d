"""Accuracy counting, the per-epoch log (stdout and CSV) and the end-of-run plot."""

from __future__ import annotations

import csv
import math
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

__all__ = ["EpochPart", "EpochRecord", "MetricsLog", "plot_records", "topk_correct"]


def topk_correct(
    logits: torch.Tensor,
    labels: torch.Tensor,
    padding: torch.Tensor | None = None,
    ks: tuple[int, ...] = (1, 5),
) -> torch.Tensor:
    """Counts samples whose label is among the top-k predictions, pads excluded.

    Stays on the device (no host synchronisation), so it can run every batch.

    Args:
        logits: ``[N, classes]``.
        labels: ``[N]`` int64.
        padding: ``[N]`` bool, True for samples to leave out; None: none.
        ks: The k values (clipped to the number of classes).

    Returns:
        int64 tensor ``[correct@k for k in ks] + [samples counted]``.
    """
    keep = ~padding if padding is not None else torch.ones_like(labels, dtype=torch.bool)
    top = logits.topk(min(max(ks), logits.shape[1]), dim=1).indices
    hits = top.eq(labels.unsqueeze(1)) & keep.unsqueeze(1)
    counts = [hits[:, : min(k, top.shape[1])].any(dim=1).sum() for k in ks]
    return torch.stack([*counts, keep.sum()])


@dataclass(frozen=True)
class EpochRecord:
    """One epoch's figures (a row of the CSV).

    ``stall_fraction`` is the share of training time the host spent waiting for
    data; ``idle_fraction`` the share of the device's time it stood idle between
    steps (CUDA events on a GPU, wall clock on the CPU: :mod:`clients.idle`);
    ``longest_wait_s`` the longest wait of any rank for one batch, past the epoch's
    first; ``wall_s`` counts from the start of training (after start-up).
    """

    epoch: int
    phase: int
    image_size: int
    batch_size: int
    lr: float
    momentum: float
    train_loss: float
    train_images: int
    train_s: float
    images_per_s: float
    stall_fraction: float
    val_loss: float = math.nan
    val_top1: float = math.nan
    val_top5: float = math.nan
    val_images: int = 0
    wall_s: float = 0.0
    longest_wait_s: float = 0.0
    idle_fraction: float = 0.0

    def line(self) -> str:
        """The stdout line for this epoch."""
        return (f"epoch {self.epoch} phase {self.phase} size {self.image_size} "
                f"bs {self.batch_size} lr {self.lr:.4g} loss {self.train_loss:.4f} "
                f"{self.images_per_s:.1f} img/s stall {self.stall_fraction:.1%} idle {self.idle_fraction:.1%} "
                f"val top1 {self.val_top1:.2%} top5 {self.val_top5:.2%} "
                f"({self.val_images} images) wall {self.wall_s:.1f} s")


@dataclass(frozen=True)
class EpochPart:
    """A training epoch's figures over some of its steps, for the whole job: what a
    checkpoint taken within an epoch carries, so that the epoch's row after a resume
    counts the steps trained before it as well (with none left, the row is the
    checkpointed part's alone).

    Attributes:
        epoch: The epoch.
        loss_sum: Training loss summed over the samples of every rank.
        images: Samples trained on, every rank.
        train_s: Wall time training.
        stall_s: ``train_s`` times the ranks' mean share of it waiting for data.
        idle_s: ``train_s`` times the ranks' mean share of device idle time.
        longest_wait_s: The longest wait of any rank for one batch.
    """

    epoch: int
    loss_sum: float = 0.0
    images: int = 0
    train_s: float = 0.0
    stall_s: float = 0.0
    idle_s: float = 0.0
    longest_wait_s: float = 0.0

    def __add__(self, later: EpochPart) -> EpochPart:
        """This part followed by ``later`` (of the same epoch)."""
        if later.epoch != self.epoch:
            raise ValueError(f"epoch {self.epoch}'s part cannot be followed by epoch {later.epoch}'s")
        return EpochPart(self.epoch, self.loss_sum + later.loss_sum, self.images + later.images,
                         self.train_s + later.train_s, self.stall_s + later.stall_s, self.idle_s + later.idle_s,
                         max(self.longest_wait_s, later.longest_wait_s))

    @property
    def figures(self) -> dict[str, Any]:
        """The training fields of an :class:`EpochRecord`."""
        seconds = self.train_s
        return {"train_loss": self.loss_sum / max(self.images, 1), "train_images": self.images,
                "train_s": seconds, "images_per_s": self.images / seconds if seconds > 0 else 0.0,
                "stall_fraction": self.stall_s / seconds if seconds > 0 else 0.0,
                "idle_fraction": self.idle_s / seconds if seconds > 0 else 0.0,
                "longest_wait_s": self.longest_wait_s}


class MetricsLog:
    """Keeps ``EpochRecord`` rows and mirrors them to a CSV file, header first.

    Args:
        path: The CSV file.
        write: False on ranks that keep the rows but leave the file to rank 0.
    """

    def __init__(self, path: Path, write: bool = True) -> None:
        self.path = path
        self.write = write
        self.records: list[EpochRecord] = []

    def append(self, record: EpochRecord) -> None:
        """Adds a row (and writes it out at once, so a crash keeps it)."""
        self.records.append(record)
        self._write()

    def load_records(self, records: list[dict]) -> None:
        """Restores earlier rows (from a checkpoint)."""
        self.records = [EpochRecord(**r) for r in records]
        self._write()

    def _write(self) -> None:
        if not self.write:
            return
        names = [f.name for f in fields(EpochRecord)]
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("w", newline="") as out:
            writer = csv.DictWriter(out, fieldnames=names)
            writer.writeheader()
            for record in self.records:
                writer.writerow(asdict(record))


def plot_records(records: list[EpochRecord], path: Path, title: str = "") -> Path:
    """Draws accuracy against wall time and images/s per epoch into a PNG.

    Returns:
        ``path``.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, (acc, speed) = plt.subplots(1, 2, figsize=(11, 4))
    wall = [r.wall_s for r in records]
    acc.plot(wall, [100 * r.val_top1 for r in records], marker="o", label="top-1")
    acc.plot(wall, [100 * r.val_top5 for r in records], marker="s", label="top-5")
    acc.set(xlabel="wall time (s)", ylabel="validation accuracy (%)", ylim=(0, 100))
    acc.legend()
    acc.grid(alpha=0.3)
    speed.bar([r.epoch for r in records], [r.images_per_s for r in records])
    speed.set(xlabel="epoch", ylabel="training images/s")
    speed.xaxis.set_major_locator(MaxNLocator(integer=True))
    speed.grid(alpha=0.3, axis="y")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
