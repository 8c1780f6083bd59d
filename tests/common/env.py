"""The environment of a child Python process that imports this project."""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["ROOT", "child_env"]

ROOT = Path(__file__).resolve().parents[2]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository first on ``PYTHONPATH``.

    What was on ``PYTHONPATH`` stays after it: a machine that brings its packages in a
    directory of its own (``PYTHONPATH=/tmp/site``) must give the child the same ones,
    or the child loads other versions (the machine's protobuf against modules made by
    the carried grpcio-tools fails protobuf's version check).
    """
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH", "")]))
    return {**os.environ, "PYTHONPATH": path, **extra}
