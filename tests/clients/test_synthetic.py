"""SyntheticLoader: same shapes, sizes and state protocol as FeederLoader."""

from __future__ import annotations

import torch

from clients import SyntheticLoader


def test_shapes_length_and_resume() -> None:
    loader = SyntheticLoader(num_samples=100, num_classes=10, batch_size=8, image_size=16,
                             world_size=2)
    assert len(loader) == 50 // 8
    images, labels = next(iter(loader))
    assert images.shape == (8, 3, 16, 16) and images.is_contiguous(memory_format=torch.channels_last)
    assert labels.dtype == torch.int64 and int(labels.max()) < 10
    state = loader.state_dict()
    assert state == {"epoch": 0, "cursor": 8, "rank": 0, "world_size": 2, "consumed": []}
    loader.set_batch_size(4)
    loader.set_image_size(24)
    assert len(loader) == (50 - 8) // 4
    assert next(iter(loader))[0].shape == (4, 3, 24, 24)
    again = SyntheticLoader(100, 10, 8, 16, world_size=2)
    again.load_state_dict(state)
    assert sum(1 for _ in again) == (50 - 8) // 8 and again.epoch == 1
