"""Waiting for something another thread or process does, with a deadline."""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["wait_for"]


def wait_for(predicate: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """True as soon as ``predicate()`` is; its last answer after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()
