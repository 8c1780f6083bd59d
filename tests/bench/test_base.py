"""The batch check every benchmarked batch goes through."""

from __future__ import annotations

import numpy as np
import torch

from bench.loaders.base import Batch, LoaderSpec, check_batch

SPEC = LoaderSpec(shards="unused", source=None, batch_size=4, image_size_px=16)


def test_correct_batches_in_either_layout_pass() -> None:
    nchw = torch.zeros((4, 3, 16, 16), dtype=torch.uint8)
    nhwc = np.zeros((4, 16, 16, 3), dtype=np.uint8)

    assert check_batch(Batch(4, nchw, "NCHW", "uint8"), SPEC) == []
    assert check_batch(Batch(4, nhwc, "NHWC", "uint8"), SPEC) == []
    assert check_batch(Batch(4, [(300, 400, 3)], "decoded", "uint8"), SPEC) == []


def test_wrong_size_layout_count_or_dtype_is_named() -> None:
    nhwc = np.zeros((4, 16, 16, 3), dtype=np.uint8)

    assert "expected (4, 3, 16, 16)" in check_batch(Batch(4, nhwc, "NCHW", "uint8"), SPEC)[0]
    assert "expected uint8" in check_batch(Batch(4, nhwc.astype(np.float32), "NHWC", "float32"), SPEC)[0]
    assert "batches of 4" in check_batch(Batch(2, nhwc[:2], "NHWC", "uint8"), SPEC)[-1]
    assert check_batch(Batch(1, [(300, 400, 1)], "decoded", "uint8"), SPEC)
