"""The trainer bench's figures, from its timed windows (:mod:`bench.train_steady`).

A window is a number of the trainer's steps timed from one device synchronisation to
the next, fed by one source (a daemon, or synthetic tensors on the device) at one
image size. Per daemon and size the headline is the trainer's step time fed against
synthetic over the same kind of window: the synthetic median over the fed median is
the share of its speed the trainer keeps (``feeder_over_synthetic``), and the ratios
of the repeats, each fed window against the synthetic window of its repeat, give its
spread. Beside it: the device's idle share between steps (CUDA events: it cannot see
a daemon's kernels time-sliced into the step, which count as busy), the host's wait
for batches, and the GPU's own counters during the window (the SMs' and the hardware
JPEG engines' utilisation, :mod:`bench.nvml`).
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass
from typing import Any

from bench.train_projection import project

__all__ = ["SYNTHETIC", "Window", "projection_basis", "summarise"]

SYNTHETIC = "synthetic"


@dataclass(frozen=True)
class Window:
    """One timed window of the trainer's steps.

    Attributes:
        source: the daemon variant's name, or ``synthetic``.
        size: image side, px.
        repeat: which repeat of the interleaved order.
        steps: steps timed.
        images: images per rank in them.
        seconds: wall time from the synchronisation before the first step to the one
            after the last (the slowest rank's).
        idle_fraction: the device's idle share between the steps (rank 0's).
        stall_fraction: the host's time waiting for batches, of ``seconds``.
        gpu_percent: NVML's GPU utilisation during the window (None: not read).
        jpeg_percent: the hardware JPEG engines' utilisation (None: not read).
        counters: where the counters came from, or why they are None.
        transport: what carried the batches (empty for synthetic data).
    """

    source: str
    size: int
    repeat: int
    steps: int
    images: int
    seconds: float
    idle_fraction: float
    stall_fraction: float
    gpu_percent: float | None
    jpeg_percent: float | None
    counters: str
    transport: str

    @property
    def step_ms(self) -> float:
        return 1000 * self.seconds / self.steps

    def record(self) -> dict[str, Any]:
        """The window as JSON-able data, its step time and rate included."""
        return asdict(self) | {"step_ms": self.step_ms, "images_per_s": self.images / self.seconds}


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _sized(fed: list[Window], synthetic: list[Window]) -> dict[str, Any]:
    """One daemon's figures at one size against the synthetic windows of that size."""
    fed_ms = statistics.median(w.step_ms for w in fed)
    figures: dict[str, Any] = {
        "windows": len(fed), "steps_per_window": fed[0].steps,
        "feeder_step_ms": fed_ms, "feeder_step_ms_range": [min(w.step_ms for w in fed), max(w.step_ms for w in fed)],
        "feeder_images_per_s": statistics.median(w.images / w.seconds for w in fed),
        "feeder_idle_fraction": statistics.median(w.idle_fraction for w in fed),
        "feeder_stall_fraction": statistics.median(w.stall_fraction for w in fed),
        "gpu_percent": _median([w.gpu_percent for w in fed]),
        "jpeg_percent": _median([w.jpeg_percent for w in fed]),
        "counters": fed[-1].counters,
    }
    if not synthetic:
        return figures
    synthetic_ms = statistics.median(w.step_ms for w in synthetic)
    by_repeat = {w.repeat: w for w in synthetic}
    ratios = [by_repeat[w.repeat].step_ms / w.step_ms for w in fed if w.repeat in by_repeat]
    synthetic_idle = statistics.median(w.idle_fraction for w in synthetic)
    return figures | {
        "synthetic_step_ms": synthetic_ms,
        "synthetic_images_per_s": statistics.median(w.images / w.seconds for w in synthetic),
        "feeder_over_synthetic": synthetic_ms / fed_ms,
        "ratio_range": [min(ratios), max(ratios)] if ratios else None,
        "synthetic_idle_fraction": synthetic_idle,
        "idle_fed_minus_synthetic": figures["feeder_idle_fraction"] - synthetic_idle,
        "synthetic_gpu_percent": _median([w.gpu_percent for w in synthetic]),
    }


def projection_basis(cores: int, gpus: int) -> str:
    """What the projection is: one GPU's measured rate, its daemon with every core of
    this machine, times ``gpus``."""
    return (f"one GPU's rate with a daemon on all {cores} cores of this machine, times {gpus}: an upper bound, "
            f"as a node's {gpus} GPUs share its cores ({cores / gpus:g} each at this count)")


def summarise(windows: list[Window], fed: list[str], cores: int, gpus: int = 8) -> dict[str, Any]:
    """Per daemon variant and size, its figures against synthetic (sizes with no
    window yet left out); each variant's projected ``imagenet-fastai`` time on
    ``gpus`` GPUs where every size it ran at has figures."""
    sizes = list(dict.fromkeys(w.size for w in windows))
    synthetic = {size: [w for w in windows if w.source == SYNTHETIC and w.size == size] for size in sizes}
    variants: dict[str, Any] = {}
    for name in fed:
        per_size = {}
        for size in sizes:
            mine = [w for w in windows if w.source == name and w.size == size]
            if mine:
                per_size[str(size)] = _sized(mine, synthetic[size])
        if not per_size:
            continue
        transports = sorted({w.transport for w in windows if w.source == name and w.transport})
        projection = project({int(s): f["feeder_images_per_s"] for s, f in per_size.items()}, gpus=gpus)
        variants[name] = {"sizes": per_size, "transport": ",".join(transports),
                          "projected_minutes": projection.minutes, "projection": projection.line()}
    synthetic_rates = {size: statistics.median(w.images / w.seconds for w in ws)
                       for size, ws in synthetic.items() if ws}
    return {
        "variants": variants,
        "synthetic_projected_minutes": project(synthetic_rates, gpus=gpus).minutes if synthetic_rates else None,
        "projection_basis": projection_basis(cores, gpus),
        "windows": [w.record() for w in windows],
    }
