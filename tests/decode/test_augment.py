"""Crop windows and flips: a pure function of (seed, epoch, key), torchvision's law."""

from __future__ import annotations

import numpy as np

from decode.augment import centre_crops, key_hashes, philox4x32, random_resized_crops
from protocol.request import CropRange

KEYS = [f"n0144{i:04d}_{i * 7}" for i in range(400)]
RNG = np.random.default_rng(0)
WIDTHS = RNG.integers(40, 600, len(KEYS))
HEIGHTS = RNG.integers(40, 600, len(KEYS))


def _crops(seed: int = 1, epoch: int = 0, rows: slice | np.ndarray = slice(None), crop: CropRange = CropRange()):
    return random_resized_crops(seed, epoch, key_hashes(KEYS)[rows], WIDTHS[rows], HEIGHTS[rows], crop)


def test_philox_matches_the_published_known_answers():
    # Random123's kat_vectors for philox4x32_10.
    zeros = philox4x32(np.zeros((1, 4), np.uint32), (0, 0))
    ones = philox4x32(np.full((1, 4), 0xFFFFFFFF, np.uint32), (0xFFFFFFFF, 0xFFFFFFFF))
    pi = philox4x32(np.array([[0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344]], np.uint32), (0xA4093822, 0x299F31D0))
    assert zeros[0].tolist() == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]
    assert ones[0].tolist() == [0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD]
    assert pi[0].tolist() == [0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1]


def test_a_sample_draws_the_same_whatever_the_batch_it_is_in():
    whole = _crops()
    order = np.random.default_rng(3).permutation(len(KEYS))
    for part in np.array_split(order, 7):
        piece = _crops(rows=part)
        assert np.array_equal(piece.boxes, whole.boxes[part])
        assert np.array_equal(piece.flips, whole.flips[part])


def test_epoch_and_seed_change_the_draws():
    base = _crops()
    for other in (_crops(epoch=1), _crops(seed=2)):
        assert (other.boxes != base.boxes).any(axis=1).mean() > 0.9
        assert (other.flips != base.flips).mean() > 0.3


def test_boxes_lie_inside_their_images():
    for crop in (CropRange(), CropRange(0.5, 1.0, 0.2, 5.0), CropRange(1.0, 1.0, 1.0, 1.0)):
        x, y, w, h = _crops(crop=crop).boxes.T
        assert (w >= 1).all() and (h >= 1).all() and (x >= 0).all() and (y >= 0).all()
        assert (x + w <= WIDTHS).all() and (y + h <= HEIGHTS).all()


def test_the_distribution_follows_the_crop_range():
    keys = [f"k{i}" for i in range(20000)]
    side = np.full(len(keys), 1000)
    crops = random_resized_crops(5, 0, key_hashes(keys), side, side, CropRange())
    w, h = crops.boxes[:, 2].astype(float), crops.boxes[:, 3].astype(float)
    area, log_ratio = w * h / 1e6, np.log(w / h)
    accepted = (w < 1000) & (h < 1000)
    assert area.min() >= 0.079 and area.max() <= 1.0
    assert abs(np.mean(area[accepted]) - 0.5) < 0.03  # uniform in [0.08, 1], less rejected big ones
    assert abs(np.mean(log_ratio)) < 0.01 and np.abs(log_ratio).max() <= np.log(4 / 3) + 0.01
    assert abs(crops.flips.mean() - 0.5) < 0.02
    assert accepted.mean() > 0.99  # square images: the fallback is rare


def test_impossible_ranges_fall_back_to_the_central_crop():
    # A 4:1 image cannot hold a crop of ratio <= 4/3 with area >= 0.9: centre, ratio clamped.
    crops = random_resized_crops(0, 0, key_hashes(["a"]), np.array([400]), np.array([100]), CropRange(0.9, 1.0))
    assert crops.boxes.tolist() == [[133, 0, 133, 100]]


def test_centre_crops_match_resize_then_centre_crop():
    crops = centre_crops(np.array([400, 256]), np.array([300, 512]))
    assert crops.boxes.tolist() == [[69, 19, 262, 262], [16, 144, 224, 224]]
    assert not crops.flips.any()

