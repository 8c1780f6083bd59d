"""The epoch plan: exactly-once delivery, equal batch counts, cursor resume."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from core.errors import InvalidArgument
from protocol.plan import (
    LastBatch,
    RankPart,
    Segment,
    batch_count,
    check_epochs_hold_batches,
    epoch_order,
    iter_batches,
    plan_length,
    rank_part,
    remaining_length,
    remaining_order,
    tail_skipped,
)


def _deliver(n, world, batch, policy, seed=3, epoch=1):
    order = epoch_order(n, seed, epoch, shuffle=True)
    per_rank = []
    for rank in range(world):
        part = rank_part(order, rank, world, policy)
        per_rank.append(list(iter_batches(part, 0, batch, policy)))
    return order, per_rank


def test_epoch_order_is_a_permutation_fixed_by_seed_and_epoch():
    a = epoch_order(100, seed=1, epoch=0, shuffle=True)
    assert sorted(a.tolist()) == list(range(100))
    assert np.array_equal(a, epoch_order(100, seed=1, epoch=0, shuffle=True))
    assert not np.array_equal(a, epoch_order(100, seed=1, epoch=1, shuffle=True))
    assert not np.array_equal(a, epoch_order(100, seed=2, epoch=0, shuffle=True))
    assert epoch_order(5, 1, 0, shuffle=False).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("world,batch", list(itertools.product([1, 2, 3, 7], [1, 5, 8])))
def test_drop_delivers_each_sample_at_most_once_in_full_batches(world, batch):
    n = 83
    _, per_rank = _deliver(n, world, batch, LastBatch.DROP)
    counts = {len(batches) for batches in per_rank}
    assert counts == {(n // world) // batch}
    seen = [int(i) for batches in per_rank for b in batches for i in b.indices]
    assert len(seen) == len(set(seen))
    assert all(len(b.indices) == batch and not b.padding.any() for bs in per_rank for b in bs)
    skipped = n % world + world * ((n // world) % batch)
    assert len(seen) + skipped == n


@pytest.mark.parametrize("world,batch", list(itertools.product([1, 2, 3, 7], [1, 5, 8])))
def test_pad_delivers_every_sample_exactly_once_plus_marked_padding(world, batch):
    n = 83
    _, per_rank = _deliver(n, world, batch, LastBatch.PAD)
    counts = {len(batches) for batches in per_rank}
    assert counts == {-(-plan_length(n, world, LastBatch.PAD) // batch)}
    real = [int(i) for bs in per_rank for b in bs for i, p in zip(b.indices, b.padding) if not p]
    assert sorted(real) == list(range(n))
    assert all(len(b.indices) == batch for bs in per_rank for b in bs)


def test_parts_are_disjoint_and_equal_length():
    order = epoch_order(50, 0, 0, shuffle=True)
    parts = [rank_part(order, r, 7, LastBatch.DROP) for r in range(7)]
    assert {len(p) for p in parts} == {7}
    assert len(set(np.concatenate([p.indices for p in parts]).tolist())) == 49
    assert parts[0].skipped == 1


def test_resume_with_other_batch_size_continues_exactly():
    order = epoch_order(61, 0, 2, shuffle=True)
    part = rank_part(order, 1, 3, LastBatch.PAD)
    whole = [int(i) for b in iter_batches(part, 0, 4, LastBatch.PAD) for i in b.indices]
    first = list(iter_batches(part, 0, 4, LastBatch.PAD, max_samples=6))
    assert [len(b.indices) for b in first] == [4, 2]
    assert first[-1].cursor == 6
    rest = list(iter_batches(part, first[-1].cursor, 7, LastBatch.PAD))
    got = [int(i) for b in first + rest for i, p in zip(b.indices, b.padding) if not p]
    assert got == [int(i) for i, p in zip(part.indices, part.padding) if not p]
    assert rest[-1].cursor == len(part)
    assert whole[:6] == got[:6]


def test_cursor_at_end_yields_nothing_and_past_end_is_rejected():
    part = rank_part(epoch_order(10, 0, 0, shuffle=False), 0, 2, LastBatch.DROP)
    assert list(iter_batches(part, 5, 2, LastBatch.DROP)) == []
    with pytest.raises(InvalidArgument, match="start_cursor"):
        list(iter_batches(part, 6, 2, LastBatch.DROP))
    with pytest.raises(InvalidArgument, match="start_cursor"):
        list(iter_batches(part, -1, 2, LastBatch.DROP))
    with pytest.raises(InvalidArgument, match="batch_size"):
        list(iter_batches(part, 0, 0, LastBatch.DROP))
    with pytest.raises(InvalidArgument, match="max_samples"):
        list(iter_batches(part, 0, 2, LastBatch.DROP, max_samples=-3))


def test_bad_rank_and_world_size():
    order = epoch_order(10, 0, 0, shuffle=False)
    with pytest.raises(InvalidArgument, match="rank"):
        rank_part(order, 2, 2, LastBatch.DROP)
    with pytest.raises(InvalidArgument, match="world_size"):
        rank_part(order, 0, 0, LastBatch.DROP)


def test_tail_skipped_counts_the_dropped_partial_batch():
    assert tail_skipped(23, 0, 5) == 3
    assert tail_skipped(23, 4, 5) == 4
    assert tail_skipped(23, 0, 5, max_samples=7) == 0
    part = rank_part(epoch_order(23, 0, 0, shuffle=False), 0, 1, LastBatch.DROP)
    got = sum(len(b.indices) for b in iter_batches(part, 4, 5, LastBatch.DROP))
    assert got + tail_skipped(23, 4, 5) == 23 - 4


def test_more_ranks_than_samples():
    order = epoch_order(3, 0, 0, shuffle=True)
    drop = [rank_part(order, r, 7, LastBatch.DROP) for r in range(7)]
    assert all(len(p) == 0 for p in drop) and drop[0].skipped == 3
    pad = [rank_part(order, r, 7, LastBatch.PAD) for r in range(7)]
    assert all(len(p) == 1 for p in pad)
    assert sorted(int(p.indices[0]) for p in pad if not p.padding[0]) == [0, 1, 2]


# -- an epoch resumed at another world size ---------------------------------------

def _delivered(part: RankPart, start: int, batch_size: int, policy: LastBatch) -> list[int]:
    """The real (not padding) samples a stream of ``part`` from ``start`` delivers."""
    return [int(i) for b in iter_batches(part, start, batch_size, policy) for i, pad in zip(b.indices, b.padding)
            if not pad]


def _consumed(order, world: int, cursors: tuple[int, ...], policy: LastBatch) -> list[int]:
    taken = []
    for rank, cursor in enumerate(cursors):
        part = rank_part(order, rank, world, policy)
        taken += [int(i) for i, pad in zip(part.indices[:cursor], part.padding[:cursor]) if not pad]
    return taken


@pytest.mark.parametrize("policy", list(LastBatch))
@pytest.mark.parametrize("old,new", [(2, 3), (3, 2), (4, 1), (1, 7)])
@pytest.mark.parametrize("unequal", [False, True])
def test_an_epoch_resumed_at_another_world_size_delivers_every_sample_once(policy, old, new, unequal):
    n, old_batch, new_batch = 101, 4, 3
    order = epoch_order(n, 5, 2, shuffle=True)
    part_length = plan_length(n, old, policy)
    ahead = old_batch if unequal else 0  # rank 0 checkpointed one batch after the others
    cursors = tuple(min(part_length, (part_length // 2) // old_batch * old_batch + (ahead if r == 0 else 0))
                    for r in range(old))
    before = _consumed(order, old, cursors, policy)
    rest = remaining_order(order, (Segment(old, cursors),), policy)
    assert len(rest) == remaining_length(n, (Segment(old, cursors),), policy) == n - len(before)
    parts = [rank_part(rest, r, new, policy) for r in range(new)]
    assert len({len(p) for p in parts}) == 1  # equal length per new rank
    after = [i for p in parts for i in _delivered(p, 0, new_batch, policy)]
    seen = before + after
    assert len(seen) == len(set(seen)), "a sample delivered twice"
    if policy is LastBatch.PAD:
        assert sorted(seen) == list(range(n)), "every sample once"
    else:
        missed = set(range(n)) - set(seen)
        assert len(missed) < new * new_batch + new, missed  # the new parts' drop remainders only


def test_segments_chain_when_a_job_changes_size_twice_in_an_epoch():
    n, policy = 60, LastBatch.PAD
    order = epoch_order(n, 0, 0, shuffle=True)
    first = Segment(2, (6, 4))
    middle = remaining_order(order, (first,), policy)
    second = Segment(3, (3, 3, 2))
    rest = remaining_order(order, (first, second), policy)
    seen = _consumed(order, 2, first.cursors, policy) + _consumed(middle, 3, second.cursors, policy)
    seen += [i for r in range(4) for i in _delivered(rank_part(rest, r, 4, policy), 0, 5, policy)]
    assert sorted(seen) == list(range(n))


@pytest.mark.parametrize("segment,message", [
    (Segment(2, (1,)), "2 cursors|1 cursors"),
    (Segment(2, (51, 0)), "outside 0..50"),
    (Segment(0, ()), "world_size 0"),
])
def test_segments_that_cannot_describe_the_epoch_are_refused(segment, message):
    with pytest.raises(InvalidArgument, match=message):
        remaining_order(np.arange(100), (segment,), LastBatch.DROP)


@pytest.mark.parametrize("policy", list(LastBatch))
def test_batch_count_is_the_number_of_batches_iter_batches_cuts(policy):
    for length, cursor, batch, limit in itertools.product(range(0, 12), range(0, 12), (1, 3, 4, 16), (0, 1, 5)):
        if cursor > length:
            continue
        part = RankPart(np.arange(length), np.zeros(length, dtype=bool), 0)
        cut = list(iter_batches(part, cursor, batch, policy, limit))
        assert batch_count(length, cursor, batch, policy, limit) == len(cut), (length, cursor, batch, limit)


def test_streams_whose_every_epoch_is_empty_are_refused_naming_why():
    check_epochs_hold_batches(16, 4, 0, 4, LastBatch.DROP, "d/val")
    check_epochs_hold_batches(16, 1000, 999, 16, LastBatch.PAD, "d/val")  # one sample and 15 repeats
    with pytest.raises(InvalidArgument, match=r"^batch_size: 5 is larger than rank 3's part of d/val \(4 samples: "
                                              r"16 over 4 ranks\); with last_batch 'drop' every epoch would be empty$"):
        check_epochs_hold_batches(16, 4, 3, 5, LastBatch.DROP, "d/val")
    with pytest.raises(InvalidArgument, match=r"^split: d/val has no samples$"):
        check_epochs_hold_batches(0, 1, 0, 1, LastBatch.PAD, "d/val")
