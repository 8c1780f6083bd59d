"""What one run of the trainer bench's rank program (:mod:`bench.train_steady`)
measures: written by ``bench/train.py`` as JSON, read by each rank."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["SteadyPlan"]


@dataclass(frozen=True)
class SteadyPlan:
    """What one run of the rank program measures (written by ``bench/train.py``).

    Attributes:
        sources: the daemon variants, name -> address, in order.
        dataset: the dataset the daemons serve.
        schedule: the schedule TOML (one phase: batch size, learning rate).
        arch: the trainer's ResNet.
        sizes: image sides, px, in the order measured.
        batch_size: per rank.
        repeats: windows per source and size.
        window_steps: steps a timed window takes at the largest size.
        settle_steps: steps before each window, untimed, at the largest size.
        warmup_steps: untimed steps of each source at each size before its first window.
        pause_s: the trainer stands idle this long before each window's settle steps
            (as validation or a checkpoint between epochs does).
        prefetch_batches: the loaders' ready batches.
        seed: the trainer's and the daemons' shuffle seed.
        out_dir: the trainer's folder.
        json: where rank 0 writes the document after each window.
        document: the document's other fields (command, config, git, machine).
        cores: this machine's CPUs (the projection's basis).
    """

    sources: dict[str, str]
    dataset: str
    schedule: str
    arch: str
    sizes: list[int]
    batch_size: int
    repeats: int
    window_steps: int
    settle_steps: int
    warmup_steps: int
    pause_s: float
    prefetch_batches: int
    seed: int
    out_dir: str
    json: str
    document: dict[str, Any]
    cores: int

    @classmethod
    def read(cls, path: Path) -> SteadyPlan:
        return cls(**json.loads(path.read_text()))

    def steps_at(self, size: int) -> tuple[int, int]:
        """(settle steps, window steps) at ``size``: scaled by pixel count from the
        largest size's, so a window lasts about as long at every size."""
        scale = (max(self.sizes) / size) ** 2
        return round(self.settle_steps * scale), round(self.window_steps * scale)
