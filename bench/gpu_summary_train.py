"""The trainer's part of the GPU check's summary (:mod:`bench.gpu_summary`), from
``bench/train.py``'s ``train.json``: per daemon and size the trainer's step time fed
against synthetic over the same steady windows (the headline), the device's idle
share, the host's wait, the GPU's and its JPEG engines' utilisation (NVML), and the
projection, labelled as what it is."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

__all__ = ["TRAIN_TARGETS", "TRAIN_VARIANT", "jpeg_line", "read_train", "train_lines", "train_targets"]

# The trainer fed by the daemon against the same trainer on synthetic data, per image
# size: the share of the synthetic step rate it keeps, at least.
TRAIN_TARGETS = {224: 0.97, 128: 0.95}
TRAIN_VARIANT = "split"  # the daemon as it runs by default: GPU decode with its tuned CPU share


def read_train(out: Path) -> dict[str, Any]:
    """``bench/train.py``'s figures: per daemon variant, per size, and its projection
    (empty without ``train.json``; ``complete`` False where the step was cut short)."""
    try:
        return json.loads((out / "train.json").read_text())["results"][0]["throughput"]  # type: ignore[no-any-return]
    except (OSError, ValueError, TypeError, KeyError, IndexError):
        return {}


def _split_first(train: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """The default daemon's first (largest) size and its figures, if it ran."""
    sizes = ((train.get("variants") or {}).get(TRAIN_VARIANT) or {}).get("sizes") or {}
    return next(iter(sizes.items()), None)


def train_targets(train: dict[str, Any], mode: str) -> list[dict[str, Any]]:
    """The trainer's targets, on the default daemon's figures (none where it did not run)."""
    figures = (train.get("variants") or {}).get(TRAIN_VARIANT)
    if not figures:
        return []
    checks = []
    for size, ratio in TRAIN_TARGETS.items():
        sized = figures["sizes"].get(str(size))
        if sized is not None and "feeder_over_synthetic" in sized:
            value = sized["feeder_over_synthetic"]
            checks.append({"target": f"trainer step fed >= {ratio:.2f}x synthetic at {size} px", "value": value,
                           "met": value >= ratio})
    first = _split_first(train)
    if first is not None:
        px, split = first
        jpeg = split.get("jpeg_percent")
        checks.append({"target": f"hardware JPEG engines busy (> 0 %) in the split daemon's windows at {px} px",
                       "value": jpeg, "met": None if jpeg is None else jpeg > 0,
                       "why": "" if jpeg is not None else f"n/a: {split.get('counters') or 'not read'}"})
    if mode != "gpu":
        for check in checks:
            check["met"], check["why"] = None, "n/a on the CPU"
    return checks


def jpeg_line(train: dict[str, Any]) -> str:
    """One line: were the hardware JPEG engines in use while the default daemon fed the
    trainer (at its first size)."""
    first = _split_first(train)
    if first is None:
        return "hardware JPEG engines: no figure (the split daemon's windows did not run)"
    size, split = first
    jpeg = split.get("jpeg_percent")
    if jpeg is None:
        return f"hardware JPEG engines: not read ({split.get('counters') or 'no reading'})"
    if jpeg == 0:
        return (f"hardware JPEG engines: 0 % busy in the split daemon's windows at {size} px: not used (DALI decoded "
                "on the SMs: no video capability in this container, or JPEGs the engines refuse)")
    return f"hardware JPEG engines: {jpeg:.0f} % busy in the split daemon's windows at {size} px (NVML): in use"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def train_lines(train: dict[str, Any]) -> list[str]:
    """The trainer's table: per daemon and size, fed against synthetic."""
    variants = train.get("variants") or {}
    if not variants:
        return ["trainer: no figures (see the train step's log)"]
    first = next(iter(next(iter(variants.values()))["sizes"].values()))
    cut = "" if train.get("complete", True) else " (cut short: the windows that finished)"
    lines = [f"trainer step, ms, fed by each daemon against the same step on synthetic data, medians of "
             f"{first['windows']} interleaved windows{cut}:",
             f"  {'daemon':<9} {'px':>4} {'fed':>7} {'synth':>7} {'ratio':>6} {'range':>13} {'idle fed':>8} "
             f"{'idle syn':>8} {'stall':>6} {'GPU %':>5} {'JPEG %':>6}  transport"]
    for name, variant in variants.items():
        for size, s in variant["sizes"].items():
            spread = s.get("ratio_range")
            lines.append(
                f"  {name:<9} {size:>4} {s['feeder_step_ms']:>7.1f} {s.get('synthetic_step_ms', float('nan')):>7.1f} "
                f"{s.get('feeder_over_synthetic', float('nan')):>6.3f} "
                f"{f'{spread[0]:.3f}-{spread[1]:.3f}' if spread else '-':>13} {s['feeder_idle_fraction']:>8.1%} "
                f"{s.get('synthetic_idle_fraction', float('nan')):>8.1%} {s['feeder_stall_fraction']:>6.1%} "
                f"{_pct(s.get('gpu_percent')):>5} {_pct(s.get('jpeg_percent')):>6}  {variant['transport']}")
        lines.append(f"  {name}: {variant['projection']}")
    minutes = train.get("synthetic_projected_minutes")
    if minutes is not None:
        lines.append(f"  synthetic: projected {minutes:.1f} min")
    if train.get("projection_basis"):
        lines.append(f"  projections: {train['projection_basis']}")
    lines.append("  idle: the device's idle share between steps (CUDA events; a daemon's kernels time-sliced into "
                 "a step count as busy: the step times are the stall figure)")
    return lines + [jpeg_line(train)]
