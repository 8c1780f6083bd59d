"""``torch.utils.data.DataLoader``'s arguments on a ``FeederLoader``: a script written
for a DataLoader keeps its ``DataLoader(...)`` statement's arguments when the
statement becomes a ``FeederLoader(...)``.

What a daemon makes for the loader (the order, the split by rank, the decoding, the
batches) cannot be chosen in this process, so each argument is one of three kinds:

- *taken*: ``shuffle`` (False: the stored order, True: a seeded permutation, None:
  the split's default), ``drop_last`` (True: ``last_batch="drop"``, False:
  ``"partial"``), and the order a ``sampler`` stands for;
- *ignored with one warning each* where the daemon does that work already:
  ``num_workers``, ``pin_memory``, ``persistent_workers``, ``prefetch_factor``, a
  stock sampler (``DistributedSampler``, ``RandomSampler``, ``SequentialSampler``:
  only its shuffle is kept), and the rest of DataLoader's tuning;
- *refused in one line* where ignoring it would change what the loop sees:
  ``collate_fn``, ``worker_init_fn``, ``batch_sampler``, a sampler of another kind.

A value equal to DataLoader's default says nothing and is not warned about.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from core.errors import ConfigError

__all__ = ["DATALOADER_DEFAULTS", "IgnoredArgumentWarning", "Taken", "take_dataloader_arguments"]

# DataLoader's own defaults: a value equal to one of these is what a script gets
# without the argument.
DATALOADER_DEFAULTS: Mapping[str, Any] = {
    "num_workers": 0, "pin_memory": False, "timeout": 0.0, "multiprocessing_context": None, "generator": None,
    "prefetch_factor": None, "persistent_workers": False, "pin_memory_device": "", "in_order": True,
}

# Ignored: each with why its work is done already (said in its warning).
_IGNORED = {
    "num_workers": "the daemon decodes and augments; this process starts no workers",
    "pin_memory": "a CUDA loader copies from pinned memory of its own",
    "persistent_workers": "the daemon's pipelines outlive every epoch already",
    "prefetch_factor": "prefetch_batches sets the ready batches held per loader",
    "timeout": "stall_timeout_s bounds the wait for a batch",
    "multiprocessing_context": "this process starts no workers",
    "generator": "the order is drawn from seed, the same on every rank",
    "pin_memory_device": "a CUDA loader copies from pinned memory of its own",
    "in_order": "batches always come in the plan's order",
}

# Refused: each with what to do instead.
_REFUSED = {
    "collate_fn": "the daemon makes the batches (uint8 images, int64 labels); change them in the loop instead",
    "worker_init_fn": "this process starts no workers to initialise",
    "batch_sampler": "the daemon cuts the batches from its plan; give batch_size and drop_last (or last_batch)",
}

# Stock samplers: what each says of the order (None: the split's default).
_STOCK_SAMPLERS = {"DistributedSampler": None, "RandomSampler": True, "SequentialSampler": False}


class IgnoredArgumentWarning(UserWarning):
    """A DataLoader argument that a ``FeederLoader`` takes and does not use."""


@dataclass(frozen=True)
class Taken:
    """What DataLoader's arguments decide of a loader.

    Attributes:
        shuffle: the order (None: the split's default: shuffled for ``train``).
        last_batch: ``"drop"``, ``"pad"`` or ``"partial"``.
    """

    shuffle: bool | None
    last_batch: str


def _sampler_shuffle(sampler: Any) -> bool | None:
    """The order a stock sampler stands for.

    Raises:
        ConfigError: a sampler of another kind (it would choose samples here).
    """
    kind = type(sampler).__name__
    if kind not in _STOCK_SAMPLERS or not type(sampler).__module__.startswith("torch.utils.data"):
        raise ConfigError(f"sampler: a {kind} chooses samples in this process, but the daemon plans each epoch's "
                          "order and splits it by rank; use shuffle, seed or a mix's weights instead")
    _ignored("sampler", f"a {kind}: the daemon splits each epoch by rank")
    if kind == "DistributedSampler":
        return bool(getattr(sampler, "shuffle", True))
    return _STOCK_SAMPLERS[kind]


def _ignored(name: str, why: str) -> None:
    warnings.warn(f"FeederLoader ignores {name} ({why})", IgnoredArgumentWarning, stacklevel=2)


def _last_batch(last_batch: str | None, drop_last: bool | None, split: str) -> str:
    """``last_batch`` as given, from ``drop_last``, else the split's default.

    Raises:
        ConfigError: ``last_batch`` and ``drop_last`` that disagree.
    """
    from_drop = None if drop_last is None else ("drop" if drop_last else "partial")
    if last_batch is not None and from_drop is not None and last_batch != from_drop:
        raise ConfigError(f"drop_last: {drop_last} asks for last_batch {from_drop!r}, but last_batch is "
                          f"{last_batch!r}; give one of them")
    return last_batch or from_drop or ("drop" if split == "train" else "partial")


def take_dataloader_arguments(given: Mapping[str, Any], split: str) -> Taken:
    """What DataLoader's arguments in ``given`` (a loader's fields by name) decide,
    warning once for each ignored one that is not DataLoader's default.

    Raises:
        ConfigError: one of the refused arguments, a sampler of another kind, or
            ``drop_last`` against ``last_batch``.
    """
    for name, instead in _REFUSED.items():
        if given.get(name) is not None:
            raise ConfigError(f"{name}: not taken by a FeederLoader: {instead}")
    for name, why in _IGNORED.items():
        if given.get(name, DATALOADER_DEFAULTS[name]) != DATALOADER_DEFAULTS[name]:
            _ignored(name, why)
    shuffle = given.get("shuffle")
    if given.get("sampler") is not None:
        shuffle = _sampler_shuffle(given["sampler"])  # DataLoader wants shuffle left out beside a sampler
    return Taken(shuffle, _last_batch(given.get("last_batch"), given.get("drop_last"), split))
