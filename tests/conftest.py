"""Shared pytest configuration: the ``gpu`` marker skips without CUDA."""

from __future__ import annotations

import pytest


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not the keywords: those hold every parent's name (a checkout in a
        # folder named "gpu" would skip everything).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)
