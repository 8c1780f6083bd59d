"""A stream's plan: its batches, numbered from its first across its epochs, and what
``drop`` skips on the way. Pure functions, no I/O. Both sides make a request's plan
here, from the request (:class:`protocol.request.StreamSpec`) and the split's size
alone: the daemon cuts a stream's batches with :func:`plan_stream` (its window,
:func:`stream_window`, and each epoch's part of the rank, :func:`rank_part_of`, cut by
:func:`stream_steps`), and the client's failover reopens streams and checks every
batch it receives with the same :func:`stream_window`'s :meth:`StreamWindow.place`
and :meth:`StreamWindow.from_number`, so both sides count batches the same way.

A stream of ``epochs`` epochs starts at ``start_cursor`` of the first epoch's part
(which may be shorter than the later ones: an elastic resume) and runs the later
epochs whole; ``max_samples`` ends the first epoch's window early. Its batches are
numbered 0, 1, ... in that order. A share of it (a rank fed by a pool of daemons)
is every ``stride``-th batch from ``offset``: reopening a share at batch ``n`` is
opening :meth:`StreamWindow.from_number` ``(n)`` with offset 0 and the same stride.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from core.errors import InvalidArgument
from protocol.mix import Mix, check_shares, mixed_order
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
    remaining_length,
    remaining_order,
    tail_skipped,
)
from protocol.request import StreamSpec

__all__ = ["BatchPlace", "Skipped", "StreamWindow", "mix_of", "plan_stream", "rank_part_of", "stream_steps",
           "stream_window"]

# What a stream's plan is drawn from: the size of a plain split, or a mix's datasets.
PlanSplit = int | Mix


@dataclass(frozen=True)
class BatchPlace:
    """Where batch ``number`` of a stream lies: its epoch and the cursors before and
    after it in the rank's part (``end`` is the batch's cursor)."""

    number: int
    epoch: int
    start: int
    end: int


@dataclass(frozen=True)
class Skipped:
    """Samples that ``drop`` skips of the epochs a stream just reached: each part's
    partial tail and, from an epoch's start, the samples the split left over among the
    ranks (``left_over``: counted once per job, by the caller for rank 0 alone)."""

    tail: int
    left_over: int


@dataclass(frozen=True)
class StreamWindow:
    """The batches of one stream, as the daemon cuts them.

    Attributes:
        epoch: the first epoch.
        epochs: epochs streamed, from ``epoch`` (at least 1).
        start_cursor: where the first epoch's batches start in its part.
        batch_size: samples per batch.
        policy: what happens to a part's partial tail.
        first_part: samples in the first epoch's part.
        part: samples in each later epoch's part.
        max_samples: the first epoch's window ends this many samples after
            ``start_cursor`` (0: at its part's end).
        left_over: samples of each later epoch no rank gets (``drop``).

    Raises:
        InvalidArgument: a field out of range (the message names it).
    """

    epoch: int
    epochs: int
    start_cursor: int
    batch_size: int
    policy: LastBatch
    first_part: int
    part: int
    max_samples: int = 0
    left_over: int = 0

    def __post_init__(self) -> None:
        if self.epochs < 1:
            raise InvalidArgument(f"epochs: must be >= 1, got {self.epochs}")
        if self.batch_size < 1:
            raise InvalidArgument(f"batch_size: must be >= 1, got {self.batch_size}")
        if not 0 <= self.start_cursor <= self.first_part:
            raise InvalidArgument(f"start_cursor: {self.start_cursor} is not in 0..{self.first_part} "
                                  f"(the rank's part of epoch {self.epoch})")
        if self.max_samples < 0:
            raise InvalidArgument(f"max_samples: must be >= 0, got {self.max_samples}")

    @property
    def first_batches(self) -> int:
        """Batches of the first epoch's window."""
        return batch_count(self.first_part, self.start_cursor, self.batch_size, self.policy, self.max_samples)

    @property
    def per_epoch(self) -> int:
        """Batches of each later epoch."""
        return batch_count(self.part, 0, self.batch_size, self.policy)

    def __len__(self) -> int:
        """Batches of the whole stream."""
        return self.first_batches + (self.epochs - 1) * self.per_epoch

    @property
    def _first_end(self) -> int:
        """Where the first epoch's window ends in its part."""
        if self.max_samples == 0:
            return self.first_part
        return min(self.first_part, self.start_cursor + self.max_samples)

    def place(self, number: int) -> BatchPlace:
        """Where batch ``number`` lies (``pad``: a padded last batch ends at its part's end).

        Raises:
            InvalidArgument: ``number`` is not a batch of the stream.
        """
        if not 0 <= number < len(self):
            raise InvalidArgument(f"batch {number} is not in 0..{len(self) - 1} of the stream")
        first = self.first_batches
        if number < first:
            start = self.start_cursor + number * self.batch_size
            return BatchPlace(number, self.epoch, start, min(start + self.batch_size, self._first_end))
        later, k = divmod(number - first, self.per_epoch)
        start = k * self.batch_size
        return BatchPlace(number, self.epoch + 1 + later, start, min(start + self.batch_size, self.part))

    def from_number(self, number: int) -> StreamWindow:
        """The stream of this one's batches from ``number`` on, numbered from 0 there:
        what reopening at batch ``number`` asks for.

        Raises:
            InvalidArgument: ``number`` is not a batch of the stream.
        """
        at = self.place(number)
        if at.epoch == self.epoch:
            limit = self.max_samples - (at.start - self.start_cursor) if self.max_samples else 0
            return StreamWindow(self.epoch, self.epochs, at.start, self.batch_size, self.policy, self.first_part,
                                self.part, limit, self.left_over)
        return StreamWindow(at.epoch, self.epoch + self.epochs - at.epoch, at.start, self.batch_size, self.policy,
                            self.part, self.part, 0, self.left_over)


def stream_steps(window: StreamWindow, part_of: Callable[[int], RankPart], stride: int = 1,
                 offset: int = 0) -> Iterator[BatchSlice | Skipped]:
    """The batches of a share of ``window`` (every ``stride``-th from ``offset``), each
    epoch's :class:`Skipped` before its batches (``drop``, the share of offset 0 only:
    a stream's shares together count each epoch once).

    Args:
        window: the stream.
        part_of: the rank's part of an epoch (called once for each epoch that holds
            a batch of the share, in order; epochs holding none are passed over
            unplanned, so a stride longer than an epoch costs no shuffle per epoch).
        stride: batches between two of the share's.
        offset: the share's first batch.

    Raises:
        InvalidArgument: a stride below 1 or an offset outside ``0..stride - 1``;
            what ``part_of`` raises.
    """
    if stride < 1 or not 0 <= offset < stride:
        raise InvalidArgument(f"batch_offset: {offset} is not in 0..{stride - 1} (batch_stride {stride})")
    counts = window.policy is LastBatch.DROP and offset == 0
    first = part_of(window.epoch)
    if counts:
        yield Skipped(tail_skipped(len(first), window.start_cursor, window.batch_size, window.max_samples),
                      first.skipped if window.start_cursor == 0 else 0)
    yield from _share(iter_batches(first, window.start_cursor, window.batch_size, window.policy, window.max_samples,
                                   epoch=window.epoch), 0, stride, offset)
    number, per_epoch, k = window.first_batches, window.per_epoch, 1
    tail = tail_skipped(window.part, 0, window.batch_size)
    while k < window.epochs and per_epoch:
        passed = min(((offset - number) % stride) // per_epoch, window.epochs - k)
        if passed:
            if counts:
                yield Skipped(passed * tail, passed * window.left_over)
            k, number = k + passed, number + passed * per_epoch
            continue
        epoch = window.epoch + k
        part = part_of(epoch)
        if counts:
            yield Skipped(tail, part.skipped)
        yield from _share(iter_batches(part, 0, window.batch_size, window.policy, epoch=epoch), number, stride, offset)
        k, number = k + 1, number + per_epoch


def _share(batches: Iterator[BatchSlice], number: int, stride: int, offset: int) -> Iterator[BatchSlice]:
    """The batches of ``batches`` (the first numbered ``number``) that are the share's."""
    for n, batch in enumerate(batches, start=number):
        if n % stride == offset:
            yield batch


def mix_of(spec: StreamSpec, sizes: tuple[int, ...]) -> Mix:
    """The mix ``spec`` asks for, over its datasets' splits of ``sizes`` samples (in
    the mix's order).

    Raises:
        InvalidArgument: ``spec`` is not a mix, a dataset its weight gives no
            sample of an epoch, or an empty split.
    """
    if not spec.mix:
        raise InvalidArgument(f"dataset: {spec.dataset!r} is not a mix")
    check_shares(spec.datasets, tuple(part.weight for part in spec.mix), spec.epoch_samples)
    try:
        return Mix(sizes, tuple(part.weight for part in spec.mix), spec.epoch_samples)
    except InvalidArgument as e:
        raise InvalidArgument(f"split: {spec.split!r} of the mix: {e}") from e


def _length(split: PlanSplit) -> int:
    """Samples of an epoch."""
    return split if isinstance(split, int) else len(split)


def stream_window(spec: StreamSpec, num_samples: PlanSplit) -> StreamWindow:
    """The batches of the stream ``spec`` asks for from a split of ``num_samples``
    (or a mix's epochs of ``epoch_samples``; its first epoch's part is of what
    ``spec.consumed`` left of it: an elastic resume).

    Raises:
        InvalidArgument: segments that cannot describe the epoch, a cursor past the
            rank's part (the message names the field).
    """
    policy, world, num_samples = spec.last_batch, spec.world_size, _length(num_samples)
    rest = remaining_length(num_samples, spec.consumed, policy) if spec.consumed else num_samples
    return StreamWindow(spec.epoch, spec.epochs, spec.start_cursor, spec.batch_size, policy,
                        plan_length(rest, world, policy), plan_length(num_samples, world, policy), spec.max_samples,
                        left_over(num_samples, world, policy))


def rank_part_of(spec: StreamSpec, num_samples: PlanSplit, epoch: int) -> RankPart:
    """The rank's part of ``epoch``: of the whole order (shuffled by ``spec.seed`` and
    ``epoch`` where :attr:`~protocol.request.StreamSpec.shuffled`, else in stored
    order), or, in the request's
    first epoch, of what the job's earlier ranks left of it (``spec.consumed``). A
    mix's order is :func:`protocol.mix.mixed_order` (composite indices).

    Raises:
        InvalidArgument: segments that cannot describe the epoch, a mix's request
            without its mix.
    """
    shuffle = spec.shuffled
    consumed = spec.consumed if epoch == spec.epoch else ()
    if isinstance(num_samples, Mix):
        order = mixed_order(num_samples, spec.seed, epoch, shuffle, spec.world_size, consumed, spec.last_batch)
    elif spec.mix:
        raise InvalidArgument(f"dataset: {spec.dataset!r} is a mix; its plan needs its datasets' sizes")
    else:
        order = epoch_order(num_samples, spec.seed, epoch, shuffle=shuffle)
        if consumed:
            order = remaining_order(order, consumed, spec.last_batch)
    return rank_part(order, spec.rank, spec.world_size, spec.last_batch)


def plan_stream(spec: StreamSpec, num_samples: PlanSplit,
                first: RankPart | None = None) -> Iterator[BatchSlice | Skipped]:
    """The batches of ``spec``'s share of its stream (every ``batch_stride``-th from
    ``batch_offset``) and what ``drop`` skips, as :func:`stream_steps` cuts them from
    :func:`stream_window` and :func:`rank_part_of`.

    Args:
        spec: the request.
        num_samples: samples in its split (a mix: its :func:`mix_of`).
        first: the rank's part of ``spec.epoch`` where the caller has it already
            (``rank_part_of(spec, num_samples, spec.epoch)``: one shuffle less).

    Raises:
        InvalidArgument: see :func:`stream_window` and :func:`stream_steps`.
    """
    def part_of(epoch: int) -> RankPart:
        if epoch == spec.epoch and first is not None:
            return first
        return rank_part_of(spec, num_samples, epoch)

    return stream_steps(stream_window(spec, num_samples), part_of, spec.batch_stride, spec.batch_offset)
