"""A job resumed at another world size and batch size: every sample of the epoch
exactly once across the ranks before and after the change, with real loaders on a
real daemon."""

from __future__ import annotations

import itertools
from collections import Counter
from fractions import Fraction

import numpy as np
import pytest

from clients import FeederLoader, merge_states
from clients.elastic import check_identity, check_state, resume
from core.errors import ConfigError
from tests.common.sample_daemon import N_TRAIN

_OLD_BATCH, _NEW_BATCH = 4, 3


def _loader(daemon: str, rank: int, world: int, batch: int, policy: str) -> FeederLoader:
    return FeederLoader("sample", address=daemon, split="train", batch_size=batch, image_size=16, rank=rank,
                        world_size=world, last_batch=policy, return_keys=True, return_padding=True, normalize=False,
                        seed=3, prefetch_next_epoch=False)


def _take(loader: FeederLoader, batches: int | None) -> list[str]:
    """Keys of the real samples of the next ``batches`` batches (None: the epoch's rest)."""
    keys = []
    for _, _, batch_keys, padding in itertools.islice(loader, batches):
        keys += [k for k, pad in zip(batch_keys, padding.tolist()) if not pad]
    return keys


@pytest.mark.parametrize("policy", ["drop", "pad"])
@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (4, 1), (1, 7)])
@pytest.mark.parametrize("unequal", [False, True], ids=["equal", "a-batch-apart"])
def test_a_job_resumed_at_another_world_size_reads_each_sample_once(daemon, policy, old, new, unequal):
    loaders = [_loader(daemon, r, old, _OLD_BATCH, policy) for r in range(old)]
    half = len(loaders[0]) // 2
    before = [k for r, loader in enumerate(loaders) for k in _take(loader, half + (1 if unequal and r == 0 else 0))]
    job = merge_states([loader.state_dict() for loader in loaders])
    for loader in loaders:
        loader.close()
    resumed = [_loader(daemon, r, new, _NEW_BATCH, policy) for r in range(new)]
    for loader in resumed:
        loader.load_state_dict(job)
    lengths = {loader.samples_per_rank for loader in resumed}
    after = [k for loader in resumed for k in _take(loader, None)]
    for loader in resumed:
        assert loader.epoch == 1  # on to the next epoch, planned for the new world
        loader.close()
    seen = Counter(before + after)
    assert max(seen.values()) == 1, "a sample delivered twice"
    assert len(lengths) == 1, "equal parts for the new ranks"
    if policy == "pad":
        assert len(seen) == N_TRAIN, "every sample once"
    else:  # only what no part holds: the remainder of the last split, under one batch a rank
        assert N_TRAIN - len(seen) < new * (_NEW_BATCH + 1)


def test_the_job_goes_on_at_the_new_size_after_the_epoch(daemon):
    loaders = [_loader(daemon, r, 2, _OLD_BATCH, "pad") for r in range(2)]
    for loader in loaders:
        _take(loader, 2)
    job = merge_states([loader.state_dict() for loader in loaders])
    resumed = _loader(daemon, 0, 3, _NEW_BATCH, "pad")
    resumed.load_state_dict(job)
    assert resumed.epoch_progress == pytest.approx(16 / (16 + 3 * resumed.samples_per_rank))  # padding counted
    _take(resumed, None)
    assert resumed.epoch == 1 and resumed.samples_per_rank == -(-N_TRAIN // 3) and resumed.epoch_progress == 0
    for loader in (*loaders, resumed):
        loader.close()


def test_one_rank_s_state_loads_only_at_its_own_world_size(daemon):
    loader = _loader(daemon, 1, 2, _OLD_BATCH, "drop")
    _take(loader, 1)
    state = loader.state_dict()
    loader.close()
    with pytest.raises(ConfigError, match="merge_states"):
        resume(state, 0, 3)
    same = _loader(daemon, 1, 2, _OLD_BATCH, "drop")
    same.load_state_dict(state)
    assert same.cursor == _OLD_BATCH
    same.close()


def test_states_of_another_job_or_dataset_are_refused_with_one_line(daemon):
    loaders = [_loader(daemon, r, 2, _OLD_BATCH, "drop") for r in range(2)]
    states = [loader.state_dict() for loader in loaders]
    with pytest.raises(ConfigError, match="ranks"):
        merge_states(states[:1] + states[:1])
    job = merge_states(states)
    other = _loader(daemon, 0, 2, _OLD_BATCH, "drop")
    for key, value in (("seed", 9), ("split", "val"), ("manifest_sha256", "0" * 64)):
        with pytest.raises(ConfigError, match=key):
            other.load_state_dict(job | {key: value})
    for loader in (*loaders, other):
        loader.close()


def test_another_rank_s_state_is_refused_naming_both(daemon):
    # Before: rank 1's state loaded on rank 0 was taken, and rank 0 skipped 16 samples.
    one = _loader(daemon, 1, 2, _OLD_BATCH, "drop")
    _take(one, 2)
    state = one.state_dict()
    zero = _loader(daemon, 0, 2, _OLD_BATCH, "drop")
    with pytest.raises(ConfigError, match=r"rank 1's; this loader is rank 0 of 2"):
        zero.load_state_dict(state)
    assert zero.cursor == 0
    for loader in (one, zero):
        loader.close()


def test_a_state_saved_by_ranks_stepping_together_loads_into_any_rank(daemon):
    # Saved in a torch.distributed group of its world size (DDP: every step collective),
    # rank 1's cursor is every rank's, as when Lightning keeps rank 0's copy alone.
    ranks = [_loader(daemon, r, 2, _OLD_BATCH, "pad") for r in range(2)]
    before = [k for loader in ranks for k in _take(loader, 2)]  # the ranks step together
    state = ranks[1].state_dict() | {"together": True}
    with _loader(daemon, 0, 2, _OLD_BATCH, "pad") as zero:
        zero.load_state_dict(state)
        assert zero.cursor == 2 * _OLD_BATCH
    # At another world size it stands for the job's state: each sample of the epoch once.
    after = []
    for rank in range(3):
        with _loader(daemon, rank, 3, _NEW_BATCH, "pad") as loader:
            loader.load_state_dict(state)
            after += _take(loader, None)
    assert Counter(before + after) == Counter({key: 1 for key in before + after}) and len(before + after) == N_TRAIN
    for loader in ranks:
        loader.close()


@pytest.mark.parametrize("cursor", [N_TRAIN, 10**12])
def test_a_cursor_past_the_part_is_refused(daemon, cursor):
    # Before: a cursor past the part at the same world size skipped the rest of the epoch.
    loader = _loader(daemon, 0, 2, _OLD_BATCH, "drop")
    state = loader.state_dict() | {"cursor": cursor}
    with pytest.raises(ConfigError, match=rf"cursor {cursor} is past the end of rank 0's part of epoch 0"):
        loader.load_state_dict(state)
    assert loader.cursor == 0 and len(loader) == N_TRAIN // 2 // _OLD_BATCH  # where it was
    loader.close()


def _mid_epoch_state(daemon: str, dataset="sample", **kwargs) -> dict:
    with FeederLoader(dataset, address=daemon, batch_size=8, image_size=16, rank=0, world_size=1, normalize=False,
                      **kwargs) as loader:
        batches = iter(loader)
        next(batches), next(batches)
        return loader.state_dict()


# Before: a key the state lacked was not checked, so a plain state loaded into a loader
# of another epoch length and epoch 1 went on with another plan; the policy and the
# shuffle were in no state.
@pytest.mark.parametrize("dataset,kwargs,line", [
    ("sample", dict(epoch_samples=96), f"epoch_samples={N_TRAIN}, this loader has 96"),
    ({"sample": 1}, dict(epoch_samples=96), f"epoch_samples={N_TRAIN}, this loader has 96"),
    ("sample", dict(last_batch="pad"), "last_batch='drop', this loader has 'pad'"),
    ("sample", dict(augment="val"), "shuffle=True, this loader has False"),
])
def test_a_state_loads_only_where_everything_that_decides_the_plan_matches(daemon, dataset, kwargs, line):
    state = _mid_epoch_state(daemon)
    with FeederLoader(dataset, address=daemon, batch_size=8, image_size=16, rank=0, world_size=1, **kwargs) as other:
        with pytest.raises(ConfigError) as caught:
            other.load_state_dict(state)
        assert str(caught.value) == f"loader state is for {line}" and other.cursor == 0


def test_a_mix_of_one_over_its_whole_split_and_its_plain_stream_take_each_others_states(daemon):
    plain = _mid_epoch_state(daemon)
    assert (plain["epoch_samples"], plain["last_batch"], plain["shuffle"]) == (N_TRAIN, "drop", True)
    one = _mid_epoch_state(daemon, {"sample": 3.0}, epoch_samples=N_TRAIN)
    assert "mix" not in one  # the same plan, sample for sample
    with FeederLoader({"sample": 1}, address=daemon, epoch_samples=N_TRAIN, batch_size=8, rank=0,
                      world_size=1) as mixed, FeederLoader("sample", address=daemon, batch_size=8, rank=0,
                                                           world_size=1) as alone:
        mixed.load_state_dict(plain)
        alone.load_state_dict(one)
        assert mixed.cursor == alone.cursor == 16


def test_a_state_from_before_the_plans_keys_were_saved_loads_where_the_defaults_hold(daemon):
    new_keys = ("epoch_samples", "last_batch", "shuffle", "augment")
    old = {k: v for k, v in _mid_epoch_state(daemon).items() if k not in new_keys}
    with FeederLoader("sample", address=daemon, batch_size=8, rank=0, world_size=1) as loader:
        loader.load_state_dict(old)  # a checkpoint of a loader with the defaults
        assert loader.cursor == 16
    unsaid = " (not in the state: the default before it was saved), this loader has"
    for kwargs, line in ((dict(epoch_samples=96), f"epoch_samples=its whole split{unsaid} 96"),
                         (dict(last_batch="pad"), f"last_batch='drop'{unsaid} 'pad'")):
        with FeederLoader("sample", address=daemon, batch_size=8, rank=0, world_size=1, **kwargs) as other:
            with pytest.raises(ConfigError) as caught:
                other.load_state_dict(old)
            assert str(caught.value) == f"loader state is for {line}"


@pytest.mark.parametrize("state, field", [
    (None, "expected a dict"),
    ({"cursor": 3}, "epoch: missing"),
    ({"epoch": "1", "cursor": 3}, "epoch: expected a count"),
    ({"epoch": 0, "cursor": -1}, "cursor: expected a count"),
    ({"epoch": 0}, "got neither"),
    ({"epoch": 0, "cursor": 1, "consumed": [[2, [1]]]}, "consumed: expected a list of"),
    ({"epoch": 0, "cursors": [1, 2], "world_size": 3}, "cursors: 2 of them for world_size 3"),
    ({"epoch": 0, "cursor": 1, "seed": 1.5}, "seed: expected an integer"),
    ({"epoch": 0, "cursor": 1, "last_batch": "partial"}, "last_batch: expected one of drop, pad"),
    ({"epoch": 0, "cursor": 1, "shuffle": 1}, "shuffle: expected true or false"),
])
def test_a_malformed_state_is_one_line_naming_the_field(daemon, state, field):
    # Before: raw TypeError / KeyError from deep inside.
    loader = _loader(daemon, 0, 2, _OLD_BATCH, "drop")
    with pytest.raises(ConfigError, match=field) as caught:
        loader.load_state_dict(state)
    assert "\n" not in str(caught.value) and str(caught.value).startswith("loader state")
    loader.close()


def test_a_states_mix_weights_may_be_any_real_number_but_a_bool():
    checked = check_state({"epoch": 0, "cursor": 0, "mix": [["a", np.float32(0.5)], ["b", Fraction(1, 4)]]})
    assert checked["mix"] == [["a", 0.5], ["b", 0.25]]
    with pytest.raises(ConfigError, match=r"^loader state: mix: expected a list of \[dataset, weight\]"):
        check_state({"epoch": 0, "cursor": 0, "mix": [["a", True]]})


def test_a_state_from_before_shuffle_was_saved_was_shuffled_under_train_augmentation():
    old = {"epoch": 0, "cursor": 8, "dataset": "d", "split": "train", "seed": 0}
    mine = {"dataset": "d", "split": "train", "seed": 0, "epoch_samples": 64, "last_batch": "drop",
            "augment": "train"}
    check_identity(check_state(old), mine | {"shuffle": True})
    with pytest.raises(ConfigError, match=r"^loader state is for shuffle=True \(not in the state: the default "
                                          r"before it was saved\), this loader has False$"):
        check_identity(check_state(old), mine | {"shuffle": False})  # a loader that reads in stored order
    check_identity(check_state(old), mine | {"augment": "val", "shuffle": False})
