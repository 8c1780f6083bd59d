"""The ``spdl`` loader's own logic: its crop windows (torchvision's law), the FFmpeg filter
graph it decodes with, its sample order, and its skip outside its venv."""

from __future__ import annotations

import importlib.util
import math
import random
from pathlib import Path
from statistics import mean

import pytest
import torch
from torchvision import transforms

from bench.loaders import LoaderSpec, LoaderUnavailable, spdl_pipeline

SIZES = [(400, 300), (300, 500), (64, 64), (112, 64), (1, 1)]


@pytest.mark.parametrize(("width", "height"), SIZES)
def test_windows_lie_inside_the_image_with_the_law_s_area_and_ratio(width: int, height: int) -> None:
    rng = random.Random(0)
    for _ in range(500):
        x, y, w, h = spdl_pipeline.crop_window(width, height, rng)
        assert 0 <= x and 0 <= y and 0 < w and 0 < h and x + w <= width and y + h <= height
        if width * height >= 64 * 64:  # rounding aside
            assert 0.07 <= w * h / (width * height) <= 1.0
            assert 3 / 4 - 0.05 <= w / h <= 4 / 3 + 0.05


def test_windows_follow_torchvision_s_random_resized_crop() -> None:
    rng, image = random.Random(0), torch.zeros((3, 300, 400))
    torch.manual_seed(0)
    ours = [spdl_pipeline.crop_window(400, 300, rng) for _ in range(3000)]
    theirs = [transforms.RandomResizedCrop.get_params(image, [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(3000)]

    def area(windows: list[tuple[int, int, int, int]]) -> float:
        return mean(w * h for *_, w, h in windows) / (400 * 300)

    def log_ratio(windows: list[tuple[int, int, int, int]]) -> float:
        return mean(math.log(w / h) for *_, w, h in windows)

    torchvision_windows = [(j, i, w, h) for i, j, h, w in theirs]  # torchvision gives (top, left, height, width)
    assert area(ours) == pytest.approx(area(torchvision_windows), abs=0.02)
    assert log_ratio(ours) == pytest.approx(log_ratio(torchvision_windows), abs=0.02)


def test_an_image_no_window_fits_gets_the_central_crop_at_the_nearest_ratio() -> None:
    rng = random.Random(0)

    assert spdl_pipeline.crop_window(1000, 10, rng) == ((1000 - 13) // 2, 0, 13, 10)
    assert spdl_pipeline.crop_window(10, 1000, rng) == (0, (1000 - 13) // 2, 10, 13)
    with pytest.raises(ValueError, match="no window"):
        spdl_pipeline.crop_window(0, 10, rng)


def test_the_filter_graph_crops_scales_bilinear_flips_and_converts_to_rgb() -> None:
    plain = spdl_pipeline.filter_desc((3, 4, 100, 80), flip=False, side_px=224)
    flipped = spdl_pipeline.filter_desc((3, 4, 100, 80), flip=True, side_px=224)

    assert plain == "crop=w=100:h=80:x=3:y=4,scale=w=224:h=224:flags=bilinear,format=pix_fmts=rgb24"
    assert flipped == "crop=w=100:h=80:x=3:y=4,scale=w=224:h=224:flags=bilinear,hflip,format=pix_fmts=rgb24"


def test_every_epoch_is_a_fresh_permutation_of_the_samples() -> None:
    order = spdl_pipeline.sample_order(50, seed=0)
    epochs = [[next(order) for _ in range(50)] for _ in range(3)]

    assert all(sorted(e) == list(range(50)) for e in epochs)
    assert epochs[0] != epochs[1] != epochs[2]
    again = spdl_pipeline.sample_order(50, seed=0)
    assert [next(again) for _ in range(50)] == epochs[0]


@pytest.mark.skipif(importlib.util.find_spec("spdl") is not None, reason="spdl is installed here")
def test_outside_its_venv_the_loader_is_skipped_with_one_line(bench_shards: Path) -> None:
    spec = LoaderSpec(shards=bench_shards, source=None, batch_size=8, image_size_px=32)

    with pytest.raises(LoaderUnavailable) as caught, spdl_pipeline.open_loader(spec):
        pass

    assert "spdl cannot be used here" in str(caught.value) and "\n" not in str(caught.value)
