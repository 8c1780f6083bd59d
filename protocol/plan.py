"""The epoch plan: which samples each rank gets, in which order, batch by batch.

Pure functions, no I/O. For (seed, epoch) the split is permuted (or kept in stored
order); rank ``r`` of ``w`` takes every ``w``-th sample of that order starting at
``r``, so the parts are disjoint and equally long:

- ``drop``: each part has ``N // w`` samples; the ``N % w`` left over are skipped this
  epoch. A stream that runs to the end of its part yields only full batches; the
  partial tail is skipped (and reported).
- ``pad``: each part has ``ceil(N / w)`` samples; the order is extended by repeating
  its start, and the repeats are marked as padding. A stream that runs to the end
  of its part fills its last batch with repeats of the part's start, also marked.

Position is a *sample cursor*: the number of samples of the part already delivered.
A stream opened at cursor ``c`` starts at position ``c`` of the part, whatever batch
size or image size the earlier streams used.

A job may stop in the middle of an epoch and resume at another world size: what its
ranks consumed is a :class:`Segment` (the world size and each rank's cursor), and the
rest of the epoch is the order minus exactly those samples, kept in order
(:func:`remaining_order`), split among the new ranks the same way. Segments chain: a
job that changes size twice in an epoch carries both.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from core.errors import InvalidArgument

__all__ = [
    "BatchSlice",
    "LastBatch",
    "RankPart",
    "Segment",
    "batch_count",
    "check_epochs_hold_batches",
    "check_segments",
    "epoch_order",
    "iter_batches",
    "left_over",
    "plan_length",
    "rank_part",
    "remaining_length",
    "remaining_order",
    "tail_skipped",
    "validate_window",
]


class LastBatch(str, enum.Enum):
    """What happens to samples that do not fill a batch or a rank's part."""

    DROP = "drop"
    PAD = "pad"


@dataclass(frozen=True)
class RankPart:
    """One rank's share of an epoch.

    Attributes:
        indices: sample indices into the split, in delivery order.
        padding: True where the index repeats an earlier sample (pad policy).
        skipped: samples of the split no rank gets this epoch (drop policy).
    """

    indices: np.ndarray
    padding: np.ndarray
    skipped: int

    def __len__(self) -> int:
        return len(self.indices)


@dataclass(frozen=True)
class BatchSlice:
    """The samples of one batch, the cursor after it, the epoch it belongs to and the
    length of the rank's part of that epoch."""

    indices: np.ndarray
    padding: np.ndarray
    cursor: int
    epoch: int = 0
    part_length: int = 0


def epoch_order(num_samples: int, seed: int, epoch: int, shuffle: bool) -> np.ndarray:
    """Order of the split for one epoch: a permutation fixed by (seed, epoch) when
    ``shuffle``, else the stored order. Same inputs, same order, on any host."""
    if not shuffle:
        return np.arange(num_samples, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFFFFFF, epoch]))
    return rng.permutation(num_samples).astype(np.int64)


def plan_length(num_samples: int, world_size: int, policy: LastBatch) -> int:
    """Samples in each rank's part."""
    if policy is LastBatch.DROP:
        return num_samples // world_size
    return -(-num_samples // world_size)


def left_over(num_samples: int, world_size: int, policy: LastBatch) -> int:
    """Samples of an epoch no rank gets (``drop``: the ``N % w`` over; ``pad``: 0)."""
    return num_samples - min(num_samples, plan_length(num_samples, world_size, policy) * world_size)


@dataclass(frozen=True)
class Segment:
    """What a job consumed of an epoch at one world size, before it stopped.

    Attributes:
        world_size: its ranks then.
        cursors: samples of its part each rank had consumed, rank 0 first.
    """

    world_size: int
    cursors: tuple[int, ...]


def _real_lengths(length: int, world_size: int, policy: LastBatch) -> np.ndarray:
    """Samples of each rank's part that are not padding, for an order of ``length``."""
    if policy is LastBatch.DROP:
        return np.full(world_size, length // world_size, dtype=np.int64)
    ranks = np.arange(world_size)
    return length // world_size + (ranks < length % world_size)


def check_segments(num_samples: int, segments: tuple[Segment, ...], policy: LastBatch) -> None:
    """Refuse segments that cannot describe an epoch of ``num_samples``.

    Raises:
        InvalidArgument: a world size below 1, a cursor list of another length, or a
            cursor outside its rank's part (the message names the segment).
    """
    length = num_samples
    for k, segment in enumerate(segments):
        if segment.world_size < 1 or len(segment.cursors) != segment.world_size:
            raise InvalidArgument(f"consumed[{k}]: {len(segment.cursors)} cursors for world_size "
                                  f"{segment.world_size}")
        part = plan_length(length, segment.world_size, policy)
        if any(not 0 <= c <= part for c in segment.cursors):
            raise InvalidArgument(f"consumed[{k}]: cursors {list(segment.cursors)} outside 0..{part} "
                                  f"(the part of each of {segment.world_size} ranks)")
        length -= int(np.minimum(segment.cursors, _real_lengths(length, segment.world_size, policy)).sum())


def remaining_length(num_samples: int, segments: tuple[Segment, ...], policy: LastBatch) -> int:
    """Samples of the epoch that the segments' ranks did not consume (checked first:
    see :func:`check_segments`)."""
    check_segments(num_samples, segments, policy)
    length = num_samples
    for segment in segments:
        length -= int(np.minimum(segment.cursors, _real_lengths(length, segment.world_size, policy)).sum())
    return length


def remaining_order(order: np.ndarray, segments: tuple[Segment, ...], policy: LastBatch) -> np.ndarray:
    """``order`` minus exactly the samples the segments' ranks consumed, in order.

    Rank ``r`` of ``w`` took every ``w``-th sample from ``r`` (as :func:`rank_part`
    splits it), so it consumed positions ``r + k * w`` for ``k`` below its cursor,
    padding repeats not counted; each segment applies to what the ones before it left.

    Raises:
        InvalidArgument: see :func:`check_segments`.
    """
    check_segments(len(order), segments, policy)
    rest = order
    for segment in segments:
        w, length = segment.world_size, len(rest)
        taken = np.minimum(segment.cursors, _real_lengths(length, w, policy))
        positions = np.arange(length)
        consumed = (positions // w) < taken[positions % w]
        rest = rest[~consumed]
    return rest


def rank_part(order: np.ndarray, rank: int, world_size: int, policy: LastBatch) -> RankPart:
    """Rank ``rank``'s strided share of ``order`` (see module docstring).

    Raises:
        InvalidArgument: world_size < 1 or rank outside 0..world_size-1.
    """
    if world_size < 1:
        raise InvalidArgument(f"world_size: must be >= 1, got {world_size}")
    if not 0 <= rank < world_size:
        raise InvalidArgument(f"rank: {rank} is not in 0..{world_size - 1} (world_size {world_size})")
    n = len(order)
    length = plan_length(n, world_size, policy)
    total = length * world_size
    if policy is LastBatch.DROP:
        full, is_pad = order[:total], np.zeros(total, dtype=bool)
    else:
        full = np.resize(order, total) if n else np.zeros(0, dtype=np.int64)
        is_pad = np.arange(total) >= n
    return RankPart(full[rank::world_size], is_pad[rank::world_size], skipped=left_over(n, world_size, policy))


def validate_window(part_length: int, start_cursor: int, max_samples: int) -> None:
    """Check a stream's start and length against the part.

    Raises:
        InvalidArgument: negative cursor or max_samples, or cursor past the end.
    """
    if start_cursor < 0:
        raise InvalidArgument(f"start_cursor: must be >= 0, got {start_cursor}")
    if start_cursor > part_length:
        raise InvalidArgument(
            f"start_cursor: {start_cursor} is past the end of this rank's part ({part_length} samples)"
        )
    if max_samples < 0:
        raise InvalidArgument(f"max_samples: must be >= 0, got {max_samples}")


def iter_batches(
    part: RankPart,
    start_cursor: int,
    batch_size: int,
    policy: LastBatch,
    max_samples: int = 0,
    epoch: int = 0,
) -> Iterator[BatchSlice]:
    """Batches of ``part`` from ``start_cursor``, stamped with ``epoch``.

    The stream covers ``[start_cursor, end)`` with ``end = part end`` or
    ``start_cursor + max_samples`` if that is sooner. A window that stops before the
    part's end ends with a short batch if needed (the cursor stays exact); at the
    part's end the policy applies: ``drop`` skips the partial batch, ``pad`` fills it.

    Raises:
        InvalidArgument: bad batch size or window (see :func:`validate_window`).
    """
    if batch_size < 1:
        raise InvalidArgument(f"batch_size: must be >= 1, got {batch_size}")
    validate_window(len(part), start_cursor, max_samples)
    end = len(part) if max_samples == 0 else min(len(part), start_cursor + max_samples)
    at_part_end = end == len(part)
    for lo in range(start_cursor, end, batch_size):
        hi = min(lo + batch_size, end)
        if hi - lo < batch_size and at_part_end:
            if policy is LastBatch.DROP:
                return
            yield _padded(part, lo, hi, batch_size, epoch)
            return
        yield BatchSlice(part.indices[lo:hi], part.padding[lo:hi], cursor=hi, epoch=epoch, part_length=len(part))


def batch_count(part_length: int, start_cursor: int, batch_size: int, policy: LastBatch, max_samples: int = 0) -> int:
    """How many batches :func:`iter_batches` cuts from a part of ``part_length``
    samples, without cutting them."""
    end = part_length if max_samples == 0 else min(part_length, start_cursor + max_samples)
    full, rest = divmod(max(end - start_cursor, 0), batch_size)
    at_part_end = end == part_length
    return full + (1 if rest and (policy is LastBatch.PAD or not at_part_end) else 0)


def check_epochs_hold_batches(num_samples: int, world_size: int, rank: int, batch_size: int, policy: LastBatch,
                              split: str) -> None:
    """Refuse a stream whose every epoch would be empty: it would serve nothing,
    however many epochs it asked for (the daemon refuses it when it opens, the loader
    when it is built).

    Args:
        split: the split's name in the message (``dataset/split``).

    Raises:
        InvalidArgument: a ``drop`` batch larger than the rank's part, or a split
            without samples.
    """
    part = plan_length(num_samples, world_size, policy)
    if batch_count(part, 0, batch_size, policy):
        return
    if not num_samples:
        raise InvalidArgument(f"split: {split} has no samples")
    raise InvalidArgument(
        f"batch_size: {batch_size} is larger than rank {rank}'s part of {split} ({part} samples: {num_samples} "
        f"over {world_size} ranks); with last_batch 'drop' every epoch would be empty"
    )


def tail_skipped(part_length: int, start_cursor: int, batch_size: int, max_samples: int = 0) -> int:
    """Samples of the part a ``drop`` stream skips at its end (0 for a window that
    ends before the part does)."""
    end = part_length if max_samples == 0 else min(part_length, start_cursor + max_samples)
    if end < part_length:
        return 0
    return (end - start_cursor) % batch_size


def _padded(part: RankPart, lo: int, hi: int, batch_size: int, epoch: int) -> BatchSlice:
    fill = batch_size - (hi - lo)
    repeat = np.resize(part.indices, fill)  # cycles from the part's start
    indices = np.concatenate([part.indices[lo:hi], repeat])
    padding = np.concatenate([part.padding[lo:hi], np.ones(fill, dtype=bool)])
    return BatchSlice(indices, padding, cursor=hi, epoch=epoch, part_length=len(part))
