"""What a training script imports: ``FeederLoader`` (batches from a feeder daemon, on
the device, normalised, channels-last, resumable), its elastic resume
(``merge_states``) and ``SyntheticLoader`` (the same batches' shapes from random
tensors, a script's speed upper bound). The bundled trainer that uses them is the
``trainer`` package, a layer above this one.

Names are imported on first use, so ``feeder --help`` and the daemon do not pay for
importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.lazy import lazy_names

if TYPE_CHECKING:
    from clients.config import LoaderConfig
    from clients.elastic import merge_states
    from clients.idle import IdleShare, StepGaps
    from clients.loader import FeederLoader
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
    "LoaderConfig": "clients.config",
    "StepGaps": "clients.idle",
    "SyntheticLoader": "clients.synthetic",
    "merge_states": "clients.elastic",
}

__getattr__ = lazy_names(__name__, _HOMES, globals())
