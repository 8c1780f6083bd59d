"""The package's plain C libraries (built by ``setup.py``, no Python API), loaded with
ctypes, which releases the GIL for each call."""

from __future__ import annotations

import ctypes
import importlib.machinery
from collections.abc import Callable
from pathlib import Path

__all__ = ["load_library"]


def load_library(
    directory: Path, stem: str, declare: Callable[[ctypes.CDLL], ctypes.CDLL], needs: str = "a C compiler is present"
) -> ctypes.CDLL | str:
    """``directory/stem*.so`` loaded and given its signatures by ``declare``, or why
    it cannot be (not built: installing builds it where ``needs`` says;
    does not load; built from an older source)."""
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        path = directory / f"{stem}{suffix}"
        if path.exists():
            try:
                return declare(ctypes.CDLL(str(path)))
            except OSError as e:
                return f"{path.name} does not load: {e}"
            except AttributeError as e:  # a function missing: built from an older source
                return f"{path.name} is out of date ({e}); reinstall (make install) to rebuild it"
    return f"{directory.name}/{stem}*.so was not built (installing builds it where {needs})"
