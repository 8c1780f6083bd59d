"""A package's public names imported on first use (PEP 562 ``__getattr__``), so
importing the package (``feeder --help``, the daemon) does not import what its
names need (torch, DALI)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module
from typing import Any

__all__ = ["lazy_names"]


def lazy_names(package: str, homes: Mapping[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """The module ``__getattr__`` of ``package``: a name of ``homes`` is imported from
    its module the first time it is asked for and kept in ``namespace`` (the
    package's globals); any other name is an AttributeError."""

    def __getattr__(name: str) -> Any:
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = namespace[name] = getattr(import_module(homes[name]), name)
        return value

    return __getattr__
