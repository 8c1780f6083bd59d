"""Shared pytest configuration: the ``gpu`` marker skips without CUDA; ``s3_server``
is a real S3 server (SeaweedFS) on loopback, started once per session when a test
asks for it; the order of the tests for pytest-xdist's workers."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from bench.seaweedfs import SeaweedFS, seaweedfs

# Fixtures that start a process or daemon: a test that asks for one is slow.
_DAEMON_FIXTURES = {"s3_server"}


def _cuda_available() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def _skip_gpu_tests(items: list[pytest.Item]) -> None:
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        # The marker, not the keywords: those hold every parent's name (a checkout in a
        # folder named "gpu" would skip everything).
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip_gpu)


def _mark_slow(items: list[pytest.Item]) -> None:
    for item in items:
        if set(getattr(item, "fixturenames", ())) & _DAEMON_FIXTURES:
            item.add_marker(pytest.mark.slow)


def _module(item: pytest.Item) -> str:
    return item.nodeid.split("::")[0]


def _heaviest_modules_first(items: list[pytest.Item]) -> None:
    """xdist gives each worker whole modules (``--dist loadfile`` in addopts: a module's
    fixtures, such as the trainer's 6-epoch reference run, are made once), in the order
    of the collection: the modules with the most slow tests go first, then the largest,
    so that the last minutes are not one worker's long module while the others idle."""
    slow: Counter[str] = Counter()
    tests: Counter[str] = Counter()
    for item in items:
        tests[_module(item)] += 1
        slow[_module(item)] += item.get_closest_marker("slow") is not None
    items.sort(key=lambda item: (-slow[_module(item)], -tests[_module(item)]))  # stable: modules stay whole


@pytest.hookimpl(tryfirst=True)  # before -m deselects by marker
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests(items)
    _mark_slow(items)
    _heaviest_modules_first(items)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """SeaweedFS with its S3 gateway on free loopback ports (``endpoint_url``,
    ``access_key``, ``secret_key``), stopped at the end of the session."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
