"""What a training script imports: ``FeederLoader`` (batches from a feeder daemon, on
the device, normalised, channels-last, resumable) and the pieces of the bundled
trainer (``python -m clients.train``).

Names are imported on first use, so ``feeder --help`` and the daemon do not pay for
importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from clients.elastic import merge_states
    from clients.loader import FeederLoader, LoaderConfig
    from clients.schedule import Phase, Schedule, load_schedule
    from clients.synthetic import SyntheticLoader
    from clients.transfer import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FeederLoader",
    "LoaderConfig",
    "Phase",
    "Schedule",
    "SyntheticLoader",
    "load_schedule",
    "merge_states",
]

_HOMES = {
    "FeederLoader": "clients.loader",
    "IMAGENET_MEAN": "clients.transfer",
    "IMAGENET_STD": "clients.transfer",
    "LoaderConfig": "clients.loader",
    "Phase": "clients.schedule",
    "Schedule": "clients.schedule",
    "SyntheticLoader": "clients.synthetic",
    "load_schedule": "clients.schedule",
    "merge_states": "clients.elastic",
}


def __getattr__(name: str) -> Any:
    if name not in _HOMES:
        raise AttributeError(f"module 'clients' has no attribute {name!r}")
    return getattr(import_module(_HOMES[name]), name)
