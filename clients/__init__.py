"""What a training script imports: ``FeederLoader`` (batches from a feeder daemon, on
the device, normalised, channels-last, resumable), its elastic resume
(``merge_states``) and ``SyntheticLoader`` (the same batches' shapes from random
tensors, a script's speed upper bound). The bundled trainer that uses them is the
``trainer`` package, a layer above this one.

Names are imported on first use, so ``feeder --help`` and the daemon do not pay for
importing torch.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

from core.lazy import lazy_names

if TYPE_CHECKING:
    from clients.elastic import merge_states
    from clients.idle import IdleShare, StepGaps
    from clients.loader import FeederLoader, LoaderConfig
    from clients.synthetic import SyntheticLoader
    from clients.transfer import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "FeederLoader",
    "IdleShare",
    "LoaderConfig",
    "StepGaps",
    "SyntheticLoader",
    "merge_states",
]

_HOMES = {
    "FeederLoader": "clients.loader",
    "IMAGENET_MEAN": "clients.transfer",
    "IMAGENET_STD": "clients.transfer",
    "IdleShare": "clients.idle",
    "LoaderConfig": "clients.loader",
    "StepGaps": "clients.idle",
    "SyntheticLoader": "clients.synthetic",
    "merge_states": "clients.elastic",
}
# The bundled trainer's names that this package exported before the trainer had a
# package of its own: they still work, with a DeprecationWarning.
_MOVED_TO_TRAINER = ("Phase", "Schedule", "load_schedule")


_lazy = lazy_names(__name__, _HOMES, globals())


def __getattr__(name: str) -> Any:
    return _moved_to_trainer(name) if name in _MOVED_TO_TRAINER else _lazy(name)


def _moved_to_trainer(name: str) -> Any:
    warnings.warn(f"clients.{name} is deprecated, use trainer.{name}", DeprecationWarning, stacklevel=3)
    from trainer import schedule  # a deprecated alias: allowed up a layer (tests/test_imports.py)

    return getattr(schedule, name)
