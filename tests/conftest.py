"""Shared pytest configuration: the ``gpu`` marker skips without CUDA; ``s3_server``
is a real S3 server (SeaweedFS) on loopback, started once per session when a test
asks for it; the order and grouping of tests for pytest-xdist's workers."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.seaweedfs import SeaweedFS, seaweedfs

# Module fixtures too costly to make on more than one worker: the tests that use one
# go to the same worker (``--dist loadgroup``, in addopts). module -> fixture.
_ONE_WORKER_FIXTURES = {
    "tests/trainer/test_loop.py": "reference",  # a whole two-rank training run of 6 epochs
}

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


def _mark_slow_and_grouped(items: list[pytest.Item]) -> None:
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if fixtures & _DAEMON_FIXTURES:
            item.add_marker(pytest.mark.slow)
        shared = _ONE_WORKER_FIXTURES.get(item.nodeid.split("::")[0])
        if shared in fixtures:
            item.add_marker(pytest.mark.xdist_group(f"{item.nodeid.split('::')[0]}:{shared}"))


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _skip_gpu_tests(items)
    _mark_slow_and_grouped(items)
    if hasattr(config, "workerinput"):
        # On xdist's workers the slow tests go first, so that the last minutes are
        # not one worker's long test while the others idle. (Alone, pytest keeps each
        # module's tests together, so that its module fixtures are made once.)
        items.sort(key=lambda item: item.get_closest_marker("slow") is None)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """SeaweedFS with its S3 gateway on free loopback ports (``endpoint_url``,
    ``access_key``, ``secret_key``), stopped at the end of the session."""
    with seaweedfs(tmp_path_factory.mktemp("seaweedfs")) as server:
        yield server
