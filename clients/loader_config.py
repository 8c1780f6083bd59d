"""``clients.loader_config``, deprecated: the loader's configuration is
:mod:`clients.config` (the name the trainer's ``TrainConfig`` had before the trainer
moved to its own package). Importing this module warns once; its names are
:mod:`clients.config`'s."""

from __future__ import annotations

import warnings
from typing import Any

from clients import config

warnings.warn("clients.loader_config is deprecated, use clients.config", DeprecationWarning, stacklevel=2)


def __getattr__(name: str) -> Any:
    return getattr(config, name)
