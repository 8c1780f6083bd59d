"""What a ``FeederLoader`` answers where code asks a ``torch.utils.data.DataLoader``
for its ``dataset``, ``sampler`` and ``batch_sampler``: frameworks (Lightning calls
``loader.sampler.set_epoch(epoch)`` before each epoch) and stock training scripts
(``len(loader.dataset)``, ``len(loader.sampler)``) keep working unchanged."""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Protocol, cast

if TYPE_CHECKING:
    from clients.config import LoaderConfig
    from clients.host_batch import PinnedFields

__all__ = ["AsDataLoader", "EpochSampler", "LoaderBatches", "ServedDataset"]


class _Loader(Protocol):
    """What these records read of their loader."""

    rank: int
    world_size: int

    @property
    def samples_per_rank(self) -> int: ...

    @property
    def batch_size(self) -> int: ...

    @property
    def epoch(self) -> int: ...

    def set_epoch(self, epoch: int) -> None: ...

    def __len__(self) -> int: ...


def _weak(loader: _Loader) -> _Loader:
    """``loader`` without a reference to it: a loader dropped without ``close()`` is
    closed as soon as it is collected, not at the next cycle collection."""
    return cast(_Loader, weakref.proxy(loader))


class ServedDataset:
    """The dataset a loader streams, as ``loader.dataset``: sized like a map-style
    dataset (``len()`` is an epoch's samples: the split's, or a mix's
    ``epoch_samples``) and naming its classes like torchvision's ``ImageFolder``.
    Its samples live with the daemon: it is not indexable.

    Attributes:
        name: the served name (a mix's names joined with ``+``).
        split: the split streamed.
        classes: class names, in label order.
        class_to_idx: class name -> label.
    """

    def __init__(self, name: str, split: str, classes: list[str], num_samples: int) -> None:
        self.name, self.split, self.classes = name, split, list(classes)
        self.class_to_idx = {name: label for label, name in enumerate(self.classes)}
        self._num_samples = num_samples

    def __len__(self) -> int:
        return self._num_samples

    def __repr__(self) -> str:
        return f"ServedDataset({self.name!r}, split={self.split!r}, samples={self._num_samples})"


class EpochSampler:
    """``loader.sampler``: what a ``DistributedSampler`` answers, for the loader's
    plan. ``set_epoch`` moves the loader (as :meth:`FeederLoader.set_epoch`);
    ``len()`` is this rank's samples of an epoch (``DistributedSampler``'s: the
    padded part under ``pad`` and ``partial``, so ``len(sampler) * world_size`` covers
    the split, the floor under ``drop``)."""

    def __init__(self, loader: _Loader, shuffle: bool) -> None:
        self._loader = _weak(loader)
        self.shuffle = shuffle
        self.num_replicas, self.rank = loader.world_size, loader.rank

    @property
    def epoch(self) -> int:
        """The loader's epoch."""
        return self._loader.epoch

    def set_epoch(self, epoch: int) -> None:
        """The loader moves to ``epoch`` (a no-op when it stands in it)."""
        self._loader.set_epoch(epoch)

    def __len__(self) -> int:
        return self._loader.samples_per_rank


class LoaderBatches:
    """``loader.batch_sampler``: the batches of an epoch as a ``BatchSampler``
    describes them (``sampler``, ``batch_size``, ``drop_last``, ``len()``)."""

    def __init__(self, loader: _Loader, sampler: EpochSampler, drop_last: bool) -> None:
        self._loader, self.sampler, self.drop_last = _weak(loader), sampler, drop_last

    @property
    def batch_size(self) -> int:
        """The loader's batch size."""
        return self._loader.batch_size

    def __len__(self) -> int:
        return len(self._loader)


class AsDataLoader:
    """What a ``DataLoader`` answers, on a loader that has its ``config`` and pinned
    memory (``_pinned``) and calls :meth:`_as_dataloader` once it knows its split.

    Attributes:
        dataset: the :class:`ServedDataset`.
        sampler: the :class:`EpochSampler`.
        batch_sampler: the :class:`LoaderBatches`.
    """

    config: LoaderConfig
    _pinned: PinnedFields | None

    def _as_dataloader(self, classes: list[str], num_samples: int, shuffled: bool) -> None:
        loader = cast(_Loader, self)
        self.dataset = ServedDataset(self.config.dataset_name, self.config.split, classes, num_samples)
        self.sampler = EpochSampler(loader, shuffled)
        self.batch_sampler = LoaderBatches(loader, self.sampler, self.drop_last)

    @property
    def dataset_name(self) -> str:
        """The dataset streamed (a mix's: its names joined with ``+``)."""
        return self.config.dataset_name

    @property
    def drop_last(self) -> bool:
        """Whether an epoch's last batch is left out when short (``last_batch="drop"``)."""
        return self.config.last_batch == "drop"

    @property
    def num_workers(self) -> int:
        """Worker processes of this loader: none (the daemon decodes)."""
        return 0

    @property
    def pin_memory(self) -> bool:
        """Whether host batches are copied from pinned memory (a CUDA loader's are)."""
        return self._pinned is not None
