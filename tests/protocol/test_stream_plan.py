"""A stream's plan: the daemon's cut of a stream (its shares, its epochs passed over,
what drop skips) is what it was before the plan became one function, and the client's
reopening at any batch gives exactly the batches from there on."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.errors import InvalidArgument
from protocol.plan import (
    BatchSlice,
    LastBatch,
    RankPart,
    batch_count,
    epoch_order,
    iter_batches,
    left_over,
    plan_length,
    rank_part,
    tail_skipped,
)
from protocol.stream_plan import Skipped, StreamWindow, stream_steps


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
