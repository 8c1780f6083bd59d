"""Turns an image folder tree into WebDataset / LMDB shards with a Parquet index and
a versioned manifest (``feeder shard``), and checks them (``feeder verify``).

Names are imported on first use, so ``feeder --help`` (which imports
``sharder.config`` and ``sharder.commands``) does not pay for Pillow and OpenCV.
"""

from __future__ import annotations

import sys
from types import ModuleType
from typing import TYPE_CHECKING, Any

from core.lazy import lazy_names

if TYPE_CHECKING:
    from sharder.config import SampleDataConfig, ShardConfig, VerifyConfig
    from sharder.sample_data import make_sample_data
    from sharder.shard import ShardReport, shard
    from sharder.upload import shard_to_store

__all__ = [
    "SampleDataConfig", "ShardConfig", "ShardReport", "VerifyConfig", "make_sample_data", "shard", "shard_to_store",
]

_HOMES = {
    "SampleDataConfig": "sharder.config",
    "ShardConfig": "sharder.config",
    "ShardReport": "sharder.shard",
    "VerifyConfig": "sharder.config",
    "make_sample_data": "sharder.sample_data",
    "shard": "sharder.shard",
    "shard_to_store": "sharder.upload",
}


__getattr__ = lazy_names(__name__, _HOMES, globals())


class _Package(ModuleType):
    """The package, whose ``shard`` stays the function: importing the submodule
    ``sharder.shard`` would otherwise set the attribute to that module."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _HOMES and isinstance(value, ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
