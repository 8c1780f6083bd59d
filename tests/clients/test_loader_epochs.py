"""A ``FeederLoader`` keeps a ``DataLoader``'s epoch contract (:mod:`clients.passes`):
``len()`` is an epoch's batches before, during and after a pass; the epoch after the
last batch comes by itself, however many batches the loop asks for; a peek does not
shorten an epoch; ``partial`` gives every sample of a split once, in short last batches."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from clients import FeederLoader
from tests.common.sample_daemon import N_TRAIN, N_VAL


def _loader(address: str, **options) -> FeederLoader:
    base = dict(dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1, return_keys=True)
    return FeederLoader(address=address, **(base | options))


def test_three_loops_of_len_batches_are_three_full_different_epochs(daemon) -> None:
    with _loader(daemon) as loader:
        epochs, lengths = [], []
        for _ in range(3):
            before = len(loader)
            keys = [k for _, _, batch in itertools.islice(loader, len(loader)) for k in batch]
            lengths.append((before, len(loader)))
            epochs.append(keys)
        assert lengths == [(N_TRAIN // 8, N_TRAIN // 8)] * 3
        for keys in epochs:
            assert len(keys) == len(set(keys)) == N_TRAIN
        assert epochs[0] != epochs[1] != epochs[2]  # a new order each epoch
        # Never asked for a batch past len(): the last pass's epoch, at its end, until a next pass.
        assert loader.epoch == 2 and loader.epoch_done


def test_set_epoch_after_a_loop_of_len_batches_goes_on_with_the_stream_opened_ahead(daemon) -> None:
    # Lightning's loop: sampler.set_epoch(epoch), then exactly len() batches.
    with _loader(daemon) as loader:
        streams, ahead = loader._streams, None
        for epoch in range(3):
            loader.sampler.set_epoch(epoch)
            assert (loader.epoch, loader.cursor) == (epoch, 0)
            assert ahead is None or ahead in (streams.current, streams.successor)  # kept, not opened again
            keys = [k for _, _, batch in itertools.islice(loader, len(loader)) for k in batch]
            assert len(keys) == N_TRAIN and (loader.epoch, loader.epoch_done) == (epoch, True)
            ahead = streams.successor or streams.current
            assert ahead is not None and ahead.fetcher.end_epoch > epoch + 1  # streams the next epoch already


def test_len_is_the_same_before_during_and_after_a_pass(daemon) -> None:
    with _loader(daemon, batch_size=16) as loader:
        during = [len(loader) for _ in loader]
        assert during == [N_TRAIN // 16] * (N_TRAIN // 16) and len(loader) == N_TRAIN // 16


def test_a_peek_before_the_loop_does_not_shorten_the_epoch(daemon, caplog) -> None:
    with _loader(daemon) as loader:
        _, _, peeked = next(iter(loader))
        batches = [keys for _, _, keys in loader]
        assert batches[0] == peeked and len(batches) == N_TRAIN // 8
        assert len({k for keys in batches for k in keys}) == N_TRAIN and loader.epoch == 1
        assert caplog.text.count("a new pass began after 1 batches of an unfinished one") == 1


def test_set_epoch_still_moves_and_a_pass_ended_early_by_it_is_not_gone_back_to(daemon) -> None:
    with _loader(daemon) as loader:
        first = next(iter(loader))[2]
        loader.set_epoch(5)
        assert loader.epoch == 5 and loader.cursor == 0
        fifth = [k for _, _, keys in loader for k in keys]
        assert len(fifth) == N_TRAIN and fifth[:8] != first and loader.epoch == 6
        loader.set_epoch(6)  # where it stands: nothing moves
        assert (loader.epoch, loader.cursor) == (6, 0)


def test_a_state_saved_at_an_epochs_end_resumes_with_the_next_epoch(daemon) -> None:
    # What a loader of an earlier release saved after its epoch's last batch: cursor at the part's end.
    with _loader(daemon) as loader:
        state = loader.state_dict() | {"epoch": 2, "cursor": N_TRAIN}
    with _loader(daemon) as resumed:
        resumed.load_state_dict(state)
        keys = [k for _, _, batch in resumed for k in batch]
        assert len(keys) == N_TRAIN and resumed.epoch == 4  # all of epoch 3, not an empty pass


@pytest.mark.parametrize("world,batch", [(3, 5), (2, 5), (4, 8), (1, 7)])
def test_partial_gives_every_image_once_in_short_last_batches(daemon, world, batch) -> None:
    for epoch in range(2):  # a pass after one that ended on a batch of repeats only
        seen: Counter[str] = Counter()
        for rank in range(world):
            with _loader(daemon, split="val", batch_size=batch, rank=rank, world_size=world,
                         return_padding=True) as loader:
                assert loader.config.last_batch == "partial" and not loader.drop_last  # the default off train
                loader.set_epoch(epoch)
                expected = len(loader)
                batches = list(loader)
                assert len(batches) == expected == len(loader)
                real = N_VAL // world + (rank < N_VAL % world)
                assert [len(keys) for _, _, keys, _ in batches] == \
                    [batch] * (real // batch) + ([real % batch] if real % batch else [])
                for images, labels, keys, padding in batches:
                    assert len(images) == len(labels) == len(padding) and not padding.any()
                    seen.update(keys)
        assert seen == Counter({key: 1 for key in seen}) and len(seen) == N_VAL


def test_a_partial_loader_goes_on_into_the_next_epoch_after_a_last_batch_of_repeats(daemon) -> None:
    # Rank 2 of 3 has 10 of the 32 images; its part's 11th place is a repeat: with
    # batches of 5 the plan's third batch holds nothing else, and is left out.
    with _loader(daemon, split="val", batch_size=5, rank=2, world_size=3) as loader:
        assert len(loader) == 2
        first = [keys for _, _, keys in loader]
        second = [keys for _, _, keys in loader]
        assert [len(k) for k in first] == [len(k) for k in second] == [5, 5] and loader.epoch == 2
        assert sorted(first) == sorted(second)  # validation: the same images every pass
