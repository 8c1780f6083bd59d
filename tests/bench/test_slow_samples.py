"""``bench/slow_samples.py``'s parts: the tree with large images it makes, and how its
summary scales the plain data's rate by the decode costs. Speed is measured by
running the benchmark, never asserted here."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from PIL import Image

from bench import slow_samples


def test_a_share_of_the_training_images_is_made_large_and_the_rest_linked(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for split, count in (("train", 10), ("val", 2)):
        (src / split / "n01").mkdir(parents=True)
        for i in range(count):
            pixels = np.random.default_rng(i).integers(0, 255, (30, 40, 3), dtype=np.uint8)
            Image.fromarray(pixels).save(src / split / "n01" / f"{i}.JPEG", quality=80)
    made = slow_samples.enlarge(src, tmp_path / "out", fraction=0.2, megapixels=(0.5, 0.6), seed=0)
    assert made == 2
    large, linked = [], []
    for path in sorted((tmp_path / "out").rglob("*.JPEG")):
        original = src / path.relative_to(tmp_path / "out")
        (linked if os.path.samefile(path, original) else large).append(path)
    assert len(large) == 2 and all("train" in p.parts for p in large) and len(linked) == 10
    for path in large:
        with Image.open(path) as image:
            assert 0.49e6 <= image.width * image.height <= 0.61e6
            assert abs(image.width / image.height - 40 / 30) < 0.01  # the photo's shape kept


def test_the_large_data_is_compared_with_the_plain_data_scaled_by_their_decode_costs() -> None:
    def run(rate: float, p99: float) -> dict:
        return {"images_per_s": rate, "daemon_cpu_ms_per_image": 1.0, "wait_median_ms": 10.0,
                "wait_p99_ms": p99, "p99_x_median": p99 / 10.0}

    runs = {("plain", 0): [run(1000, 15), run(1200, 15), run(1100, 15)], ("large", 0): [run(700, 30)] * 3}
    rows = {r["data"]: r for r in slow_samples._summary(runs, {"plain": [0.5, 0.5], "large": [0.8, 0.8]})}
    assert rows["plain"]["images_per_s"] == 1100  # medians over rounds
    assert rows["large"]["scaled_images_per_s"] == 1100 * 0.5 / 0.8
    assert rows["large"]["x_scaled"] == round(700 / (1100 * 0.5 / 0.8), 3)
    assert rows["large"]["p99_x_median"] == 3.0
