"""A ``DataLoader(...)`` statement's arguments on a ``FeederLoader``, and what it
answers where code asks a DataLoader (:mod:`clients.dataloader_args`,
:mod:`clients.dataloader_attrs`)."""

from __future__ import annotations

import warnings

import pyarrow.parquet as pq
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler, WeightedRandomSampler

from clients import FeederLoader, LoaderConfig
from clients.dataloader_args import IgnoredArgumentWarning
from core.errors import ConfigError
from shards.layout import index_path
from tests.common.sample_daemon import CLASSES, N_TRAIN, N_VAL

_BASE = dict(address="127.0.0.1:1", dataset="sample")


def _config(**fields) -> LoaderConfig:
    return LoaderConfig(**(_BASE | fields))


def test_dataloaders_own_arguments_are_taken_with_one_warning_each_where_not_its_defaults() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _config(num_workers=0, pin_memory=False, persistent_workers=False, prefetch_factor=None, timeout=0)
        assert not caught
        _config(num_workers=8, pin_memory=True, persistent_workers=True, prefetch_factor=2, timeout=30.0,
                generator=torch.Generator().manual_seed(1), in_order=False)
    said = [str(w.message) for w in caught if issubclass(w.category, IgnoredArgumentWarning)]
    assert len(said) == len(caught) == 7
    for name in ("num_workers", "pin_memory", "persistent_workers", "prefetch_factor", "timeout", "generator",
                 "in_order"):
        assert sum(m.startswith(f"FeederLoader ignores {name} (") for m in said) == 1, said


@pytest.mark.parametrize("name,value,why", [
    ("collate_fn", lambda batch: batch, "the daemon makes the batches"),
    ("worker_init_fn", lambda worker: None, "no workers"),
    ("batch_sampler", BatchSampler(range(8), 4, False), "give batch_size and drop_last"),
    ("sampler", WeightedRandomSampler([1.0, 2.0], 2), "chooses samples in this process"),
])
def test_what_would_change_the_batches_is_refused_in_one_line(name, value, why) -> None:
    with pytest.raises(ConfigError, match=f"^{name}: .*{why}") as refused:
        _config(**{name: value})
    assert "\n" not in str(refused.value)


@pytest.mark.parametrize("sampler,shuffle", [
    (DistributedSampler(range(N_TRAIN), num_replicas=2, rank=1), True),
    (DistributedSampler(range(N_VAL), num_replicas=2, rank=0, shuffle=False, drop_last=True), False),
    (RandomSampler(range(8)), True),
    (SequentialSampler(range(8)), False),
])
def test_a_stock_sampler_gives_its_shuffle_and_is_otherwise_ignored(sampler, shuffle) -> None:
    with pytest.warns(IgnoredArgumentWarning, match="ignores sampler .*the daemon splits each epoch by rank"):
        config = _config(sampler=sampler, shuffle=False)  # DataLoader wants shuffle off beside a sampler
    assert config.shuffle is shuffle and config.last_batch == "drop"  # its drop_last is not the loader's


@pytest.mark.parametrize("fields,last_batch", [
    ({}, "drop"), (dict(split="val"), "partial"), (dict(drop_last=True, split="val"), "drop"),
    (dict(drop_last=False), "partial"), (dict(last_batch="pad", split="val"), "pad"),
    (dict(last_batch="drop", drop_last=True), "drop"),
])
def test_drop_last_and_the_splits_default_set_the_last_batch(fields, last_batch) -> None:
    assert _config(**fields).last_batch == last_batch


def test_drop_last_against_last_batch_is_refused() -> None:
    with pytest.raises(ConfigError, match="^drop_last: True asks for last_batch 'drop', but last_batch is 'pad'"):
        _config(drop_last=True, last_batch="pad")


def test_dataset_sampler_and_batch_sampler_answer_as_a_dataloaders(daemon) -> None:
    with FeederLoader("sample", address=daemon, batch_size=8, image_size=32, rank=1, world_size=2) as loader:
        assert len(loader.dataset) == N_TRAIN and loader.dataset_name == "sample"
        assert loader.dataset.classes == loader.classes and len(loader.classes) == CLASSES
        assert loader.dataset.class_to_idx == {name: label for label, name in enumerate(loader.classes)}
        sampler = loader.sampler
        assert len(sampler) == N_TRAIN // 2 and sampler.shuffle and (sampler.num_replicas, sampler.rank) == (2, 1)
        assert loader.batch_sampler.sampler is sampler and len(loader.batch_sampler) == len(loader) == N_TRAIN // 16
        assert loader.batch_sampler.batch_size == 8 and loader.batch_sampler.drop_last
        assert (loader.drop_last, loader.num_workers, loader.pin_memory) == (True, 0, False)
        sampler.set_epoch(3)  # what Lightning calls before each epoch
        assert loader.epoch == sampler.epoch == 3
    with FeederLoader("sample", address=daemon, split="val", batch_size=8, image_size=32, rank=2,
                      world_size=3) as val:
        # DistributedSampler's length (the padded part), so len(sampler) * world_size covers the split
        assert len(val.sampler) == -(-N_VAL // 3) and not val.sampler.shuffle and not val.drop_last


def test_shuffle_false_reads_the_stored_order_and_true_shuffles_any_split(daemon, shards) -> None:
    stored = pq.read_table(index_path(shards, "train"), columns=["key"]).column("key").to_pylist()
    options = dict(address=daemon, batch_size=8, image_size=32, rank=0, world_size=1, return_keys=True)
    with FeederLoader("sample", shuffle=False, **options) as in_order:
        epochs = [[k for _, _, keys in in_order for k in keys] for _ in range(2)]
    assert epochs == [stored, stored]
    with FeederLoader("sample", split="val", shuffle=True, **options) as shuffled:
        epochs = [[k for _, _, keys in shuffled for k in keys] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) and len(set(epochs[0])) == N_VAL and epochs[0] != epochs[1]
    with pytest.warns(IgnoredArgumentWarning):
        sampler = DistributedSampler(range(N_TRAIN), num_replicas=1, rank=0, shuffle=False)
        with FeederLoader("sample", sampler=sampler, **options) as from_sampler:
            assert [k for _, _, keys in from_sampler for k in keys] == stored and not from_sampler.sampler.shuffle
