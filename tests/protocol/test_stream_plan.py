"""A stream's plan: the daemon's cut of a stream (its shares, its epochs passed over,
what drop skips) is what it was before the plan became one function, and the client's
reopening at any batch gives exactly the batches from there on. A request's whole
plan (:func:`plan_stream`: ranks, elastic resumes, shares) is checked against a
reference written from the plan's rules alone, sample by sample, and the window both
sides number batches by (:func:`stream_window`) against the batches cut."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from core.errors import InvalidArgument
from protocol.mix import Mix, mixed_order
from protocol.plan import (
    BatchSlice,
    LastBatch,
    RankPart,
    Segment,
    batch_count,
    check_epochs_hold_batches,
    epoch_order,
    iter_batches,
    left_over,
    plan_length,
    rank_part,
    tail_skipped,
)
from protocol.request import MixPart, StreamSpec, mix_name
from protocol.stream_plan import Skipped, StreamWindow, plan_stream, rank_part_of, stream_steps, stream_window


def _reference(n: int, world: int, rank: int, batch: int, policy: LastBatch, epoch: int, epochs: int, cursor: int,
               limit: int, stride: int, offset: int, skipped: list[int]) -> Iterator[BatchSlice]:
    """The daemon's cut as ``FeederService._slices`` wrote it before (c5352dd)."""
    def part(e: int) -> RankPart:
        return rank_part(epoch_order(n, 5, e, True), rank, world, policy)

    def count(part_length: int, c: int, lim: int, remainder: int, times: int = 1) -> None:
        if policy is LastBatch.DROP and offset == 0:
            tail = tail_skipped(part_length, c, batch, lim)
            skipped.append(times * (tail + (remainder if c == 0 and rank == 0 else 0)))

    def epoch_slices(p: RankPart, e: int, c: int, lim: int, number: int) -> Iterator[BatchSlice]:
        count(len(p), c, lim, p.skipped)
        for k, b in enumerate(iter_batches(p, c, batch, policy, lim, epoch=e), start=number):
            if k % stride == offset:
                yield b

    first = part(epoch)
    yield from epoch_slices(first, epoch, cursor, limit, 0)
    number = batch_count(len(first), cursor, batch, policy, limit)
    full = plan_length(n, world, policy)
    per_epoch = batch_count(full, 0, batch, policy)
    k = 1
    while k < epochs and per_epoch:
        passed = min(((offset - number) % stride) // per_epoch, epochs - k)
        if passed:
            count(full, 0, 0, left_over(n, world, policy), passed)
            k, number = k + passed, number + passed * per_epoch
            continue
        yield from epoch_slices(part(epoch + k), epoch + k, 0, 0, number)
        k, number = k + 1, number + per_epoch


@st.composite
def streams(draw: st.DrawFn) -> dict:
    n = draw(st.integers(1, 60))
    world = draw(st.integers(1, 4))
    policy = draw(st.sampled_from(list(LastBatch)))
    part = plan_length(n, world, policy)
    stride = draw(st.integers(1, 5))
    return dict(n=n, world=world, rank=draw(st.integers(0, world - 1)), batch=draw(st.integers(1, 9)), policy=policy,
                epoch=draw(st.integers(0, 3)), epochs=draw(st.integers(1, 6)), cursor=draw(st.integers(0, part)),
                limit=draw(st.sampled_from([0, 0, 1, 5, 13])), stride=stride, offset=draw(st.integers(0, stride - 1)))


def _window(s: dict) -> StreamWindow:
    part = plan_length(s["n"], s["world"], s["policy"])
    return StreamWindow(s["epoch"], s["epochs"], s["cursor"], s["batch"], s["policy"], part, part, s["limit"],
                        left_over(s["n"], s["world"], s["policy"]))


def _part_of(s: dict):
    return lambda e: rank_part(epoch_order(s["n"], 5, e, True), s["rank"], s["world"], s["policy"])


def _steps(s: dict, window: StreamWindow | None = None, stride: int | None = None,
           offset: int | None = None) -> tuple[list[BatchSlice], list[int]]:
    batches, skipped = [], []
    for step in stream_steps(window or _window(s), _part_of(s), s["stride"] if stride is None else stride,
                             s["offset"] if offset is None else offset):
        if isinstance(step, Skipped):
            skipped.append(step.tail + (step.left_over if s["rank"] == 0 else 0))
        else:
            batches.append(step)
    return batches, skipped


def _same(a: list[BatchSlice], b: list[BatchSlice]) -> bool:
    return len(a) == len(b) and all(
        x.epoch == y.epoch and x.cursor == y.cursor and np.array_equal(x.indices, y.indices)
        and np.array_equal(x.padding, y.padding) for x, y in zip(a, b))


@pytest.mark.slow
@settings(max_examples=400, deadline=None)
@given(streams())
def test_the_daemons_cut_of_a_share_is_what_it_was(s):
    skipped: list[int] = []
    expected = list(_reference(**s, skipped=skipped))
    batches, counted = _steps(s)
    assert _same(batches, expected)
    assert sum(counted) == sum(skipped)


@settings(max_examples=300, deadline=None)
@given(streams())
def test_every_batch_is_where_place_says_and_the_shares_make_the_whole_stream(s):
    window = _window(s)
    whole, _ = _steps(s, stride=1, offset=0)
    assert len(whole) == len(window)
    for number, batch in enumerate(whole):
        place = window.place(number)
        assert (place.epoch, place.end) == (batch.epoch, batch.cursor)
        if number and window.place(number - 1).epoch == place.epoch:
            assert place.start == window.place(number - 1).end
    shares = [_steps(s, stride=s["stride"], offset=k)[0] for k in range(s["stride"])]
    interleaved = [shares[n % s["stride"]][n // s["stride"]] for n in range(len(whole))]
    assert _same(interleaved, whole)


@settings(max_examples=300, deadline=None)
@given(streams(), st.data())
def test_reopening_at_a_batch_gives_exactly_the_stream_from_there(s, data):
    window = _window(s)
    if not len(window):
        return
    number = data.draw(st.integers(0, len(window) - 1))
    whole, _ = _steps(s, stride=1, offset=0)
    again, _ = _steps(s, window=window.from_number(number), stride=s["stride"], offset=0)
    assert _same(again, whole[number::s["stride"]])
    assert len(window.from_number(number)) == len(window) - number


def test_a_batch_outside_the_stream_has_no_place():
    window = StreamWindow(0, 2, 0, 4, LastBatch.DROP, 10, 10)
    assert len(window) == 4
    with pytest.raises(InvalidArgument, match="batch 4 is not in 0..3"):
        window.place(4)
    with pytest.raises(InvalidArgument, match="start_cursor: 11"):
        StreamWindow(0, 1, 11, 4, LastBatch.DROP, 10, 10)


def test_the_first_epoch_of_an_elastic_resume_is_shorter():
    window = StreamWindow(3, 3, 2, 4, LastBatch.DROP, first_part=10, part=16)
    assert window.first_batches == 2 and window.per_epoch == 4 and len(window) == 10
    assert window.place(1) == type(window.place(1))(1, 3, 6, 10)
    assert window.place(2) == type(window.place(2))(2, 4, 0, 4)
    later = window.from_number(6)
    assert (later.epoch, later.start_cursor, later.epochs, later.first_part) == (5, 0, 1, 16)


# -- a request's whole plan, against the rules written out sample by sample ---------


def _naive_rest(order: list[int], consumed: tuple[Segment, ...], policy: LastBatch) -> list[int]:
    """``order`` less what each segment's ranks consumed: rank ``r`` of ``w`` took
    positions ``r``, ``r + w``, ... of what the segments before left, its first
    ``cursor`` of them, padding repeats (``pad``: past the order's end; ``drop``: past
    the last whole round of ``w``) not counted."""
    for segment in consumed:
        w = segment.world_size
        real = len(order) // w * w if policy is LastBatch.DROP else len(order)
        taken = {r + k * w for r, cursor in enumerate(segment.cursors) for k in range(cursor) if r + k * w < real}
        order = [sample for position, sample in enumerate(order) if position not in taken]
    return order


def _naive_part(order: list[int], rank: int, world: int, policy: LastBatch) -> tuple[list[int], list[bool], int]:
    """Rank ``rank``'s samples of ``order`` (every ``world``-th from ``rank``; ``pad``:
    the order repeated from its start to fill the last round, marked), and the samples
    no rank gets (``drop``)."""
    rounds = len(order) // world if policy is LastBatch.DROP else -(-len(order) // world)
    positions = [rank + k * world for k in range(rounds)]
    return ([order[p % len(order)] for p in positions], [p >= len(order) for p in positions],
            len(order) - rounds * world if policy is LastBatch.DROP else 0)


def _naive_epoch(spec: StreamSpec, n: int, epoch: int) -> tuple[list[tuple], int]:
    """(epoch, cursor, indices, padding) of each batch of ``epoch`` in ``spec``'s
    stream, and what ``drop`` skips of it."""
    first = epoch == spec.epoch
    consumed = spec.consumed if first else ()
    # Shuffled as the request says, where it says; else under train augmentation (of "train").
    shuffle = spec.split == "train" if spec.shuffle is None else spec.shuffle
    if isinstance(n, Mix):  # the mix's order after the segments (tests/protocol/test_mix.py), cut as any
        rest = mixed_order(n, spec.seed, epoch, shuffle, spec.world_size, consumed, spec.last_batch)
        order = [int(i) for i in rest]
    else:
        order = _naive_rest([int(i) for i in epoch_order(n, spec.seed, epoch, shuffle=shuffle)], consumed,
                            spec.last_batch)
    indices, padding, left = _naive_part(order, spec.rank, spec.world_size, spec.last_batch)
    start, size = (spec.start_cursor if first else 0), spec.batch_size
    end = min(len(indices), start + spec.max_samples) if first and spec.max_samples else len(indices)
    batches, tail = [], 0
    for lo in range(start, end, size):
        hi = min(lo + size, end)
        if hi - lo < size and end == len(indices):  # the part's partial tail
            if spec.last_batch is LastBatch.DROP:
                tail = hi - lo
                break
            fill = size - (hi - lo)
            batches.append((epoch, hi, indices[lo:hi] + [indices[k % len(indices)] for k in range(fill)],
                            padding[lo:hi] + [True] * fill))
            break
        batches.append((epoch, hi, indices[lo:hi], padding[lo:hi]))
    return batches, (tail + (left if start == 0 else 0) if spec.last_batch is LastBatch.DROP else 0)


def _naive_stream(spec: StreamSpec, n: int) -> tuple[list[tuple], int]:
    """The share's batches of the whole stream, and what ``drop`` skips of it (counted
    by the share of offset 0)."""
    batches, skipped = [], 0
    for epoch in range(spec.epoch, spec.epoch + spec.epochs):
        cut, skips = _naive_epoch(spec, n, epoch)
        batches += cut
        skipped += skips
    share = [b for number, b in enumerate(batches) if number % spec.batch_stride == spec.batch_offset]
    return share, skipped if spec.batch_offset == 0 else 0


@st.composite
def requests(draw: st.DrawFn) -> tuple[StreamSpec, int]:
    """A request the daemon opens (every epoch holds a batch), elastic resumes
    included: up to two segments of what the job read of its first epoch before."""
    policy, world = draw(st.sampled_from(list(LastBatch))), draw(st.integers(1, 4))
    n = draw(st.integers(world if policy is LastBatch.DROP else 1, 60))
    batch = draw(st.integers(1, min(9, plan_length(n, world, policy)) if policy is LastBatch.DROP else 9))
    check_epochs_hold_batches(n, world, 0, batch, policy, "d/s")  # what the daemon opens
    consumed, rest = [], n
    for _ in range(draw(st.integers(0, 2))):
        w = draw(st.integers(1, 4))
        cursors = tuple(draw(st.integers(0, plan_length(rest, w, policy))) for _ in range(w))
        consumed.append(Segment(w, cursors))
        rest = len(_naive_rest(list(range(rest)), (consumed[-1],), policy))
    first_part = plan_length(rest, world, policy)
    stride = draw(st.integers(1, 4))
    spec = StreamSpec(
        "d", draw(st.sampled_from(["train", "val"])), shuffle=draw(st.sampled_from([None, True, False])),
        rank=draw(st.integers(0, world - 1)), world_size=world,
        batch_size=batch, image_size=16, seed=draw(st.integers(0, 3)), epoch=draw(st.integers(0, 3)),
        start_cursor=draw(st.integers(0, first_part)), max_samples=draw(st.sampled_from([0, 0, 1, 5, 13])),
        epochs=draw(st.integers(1, 5)), last_batch=policy, consumed=tuple(consumed), batch_stride=stride,
        batch_offset=draw(st.integers(0, stride - 1)))
    return spec, n


def _cut(spec: StreamSpec, n: int, first: RankPart | None = None) -> tuple[list[tuple], int]:
    batches, skipped = [], 0
    for step in plan_stream(spec, n, first):
        if isinstance(step, Skipped):
            skipped += step.tail + step.left_over
        else:
            batches.append((step.epoch, step.cursor, step.indices.tolist(), step.padding.tolist()))
    return batches, skipped


@settings(max_examples=400, deadline=None)
@given(requests())
def test_a_requests_plan_is_the_plans_rules_sample_by_sample(request):
    spec, n = request
    assert _cut(spec, n) == _naive_stream(spec, n)
    # The daemon hands in the first epoch's part it made when the stream opened.
    assert _cut(spec, n, rank_part_of(spec, n, spec.epoch)) == _naive_stream(spec, n)


@settings(max_examples=300, deadline=None)
@given(requests())
def test_the_window_both_sides_number_by_places_every_batch_the_daemon_cuts(request):
    spec, n = request
    window = stream_window(spec, n)
    whole = dataclasses.replace(spec, batch_stride=1, batch_offset=0)
    batches, _ = _cut(whole, n)
    assert window.first_part == len(rank_part_of(spec, n, spec.epoch))
    assert len(window) == len(batches)
    for number, (epoch, cursor, _, _) in enumerate(batches):
        place = window.place(number)
        assert (place.epoch, place.end) == (epoch, cursor)
    # The client reopens its share at the batch it owes: from there, the daemon cuts
    # exactly the share's batches that were still to come.
    share, _ = _cut(spec, n)
    for k, number in enumerate(range(spec.batch_offset, len(window), spec.batch_stride)):
        again = window.from_number(number)
        reopened = dataclasses.replace(
            spec, epoch=again.epoch, epochs=again.epochs, start_cursor=again.start_cursor,
            max_samples=again.max_samples, batch_offset=0, consumed=spec.consumed if again.epoch == spec.epoch else ())
        assert _cut(reopened, n)[0] == share[k:]


@st.composite
def mixed_requests(draw: st.DrawFn) -> tuple[StreamSpec, Mix]:
    """A request of a mix of two or three datasets, as :func:`requests` draws one."""
    spec, n = draw(requests())
    k = draw(st.integers(2, 3))
    sizes = tuple(draw(st.lists(st.integers(1, 30), min_size=k, max_size=k)))
    weights = tuple(draw(st.lists(st.floats(0.1, 4.0), min_size=k, max_size=k)))
    parts = tuple(MixPart(f"d{i}", w) for i, w in enumerate(weights))
    assume(n >= k)
    mixed = dataclasses.replace(spec, dataset=mix_name(parts), mix=parts, epoch_samples=n)
    return mixed, Mix(sizes, weights, n)


@pytest.mark.slow
@settings(max_examples=300, deadline=None)
@given(mixed_requests())
def test_a_mixed_requests_stream_is_its_orders_cut_as_a_plain_ones(request):
    spec, mix = request
    assert _cut(spec, mix) == _naive_stream(spec, mix)
    window = stream_window(spec, mix)
    assert window == stream_window(spec, mix.epoch_samples)  # the client numbers by the epoch's length alone
    assert window.first_part == len(rank_part_of(spec, mix, spec.epoch))


@pytest.mark.parametrize("split,shuffle,shuffled", [
    ("train", None, True), ("val", None, False), ("train", False, False), ("val", True, True)])
def test_the_request_decides_whether_an_epoch_is_shuffled(split, shuffle, shuffled):
    stored = list(range(40))
    plain = StreamSpec("d", split, shuffle=shuffle)
    parts = (MixPart("a", 1.0), MixPart("b", 3.0))
    mixed = StreamSpec("a+b", split, shuffle=shuffle, mix=parts, epoch_samples=40)
    mix = Mix((10, 30), (1.0, 3.0), 40)
    for epoch in (0, 1):
        order = rank_part_of(plain, 40, epoch).indices.tolist()
        assert sorted(order) == stored and (order != stored) == shuffled
        draws = mix.dataset_of(rank_part_of(mixed, mix, epoch).indices)
        each = [rank_part_of(mixed, mix, epoch).indices[draws == k].tolist() for k in (0, 1)]
        assert [sorted(d) for d in each] == [list(range(10)), list(range(10, 40))]
        assert (each != [list(range(10)), list(range(10, 40))]) == shuffled  # each dataset's pass, in its order


def test_a_mixed_request_without_its_mix_is_refused():
    parts = (MixPart("a", 1.0), MixPart("b", 1.0))
    spec = StreamSpec(dataset="a+b", split="train", mix=parts, epoch_samples=10)
    with pytest.raises(InvalidArgument, match="is a mix"):
        rank_part_of(spec, 10, 0)
