"""Shared pytest configuration: the ``gpu`` marker skips without CUDA; ``s3_server``
is a real S3 server (SeaweedFS) on loopback, started once per session when a test
asks for it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.seaweedfs import SeaweedFS, seaweedfs


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """SeaweedFS with its S3 gateway on free loopback ports (``endpoint_url``,
    ``access_key``, ``secret_key``), stopped at the end of the session."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
