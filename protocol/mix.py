"""The plan of a stream that mixes several datasets with weights: the composite split.

Pure functions, no I/O; a pure function of (seed, weights, epoch_samples, the
datasets' sizes and their order), the sizes standing for the datasets' identities
(a request carries each one's manifest and index digests, checked on every open).

- **Samples per epoch.** An epoch holds ``epoch_samples`` samples (``E``); dataset
  ``k`` contributes ``n_k``, its weight's share of ``E`` by largest remainders (exact
  rationals, ties to the earlier dataset), so the ``n_k`` add up to ``E``
  (:func:`epoch_counts`).
- **Each dataset's own passes.** Dataset ``k`` is read as a sequence of passes, each a
  permutation of its samples fixed by ``(seed, pass, k)`` (the first dataset's by
  ``(seed, pass)``, as a plain stream's epoch); epoch ``e`` takes positions ``e·n_k``
  to ``(e+1)·n_k`` of that sequence (:func:`epoch_draws`). Every sample of a dataset
  is drawn once per pass before any is drawn again, across epoch boundaries; a
  dataset smaller than its ``n_k`` is repeated pass after pass, a larger one is
  covered over several epochs.
- **Composite indices.** Sample ``j`` of dataset ``k`` is ``offsets[k] + j`` of the
  composite split (the datasets' samples one after the other, in the order given).
- **Stratified parts.** The epoch's draws are laid out for a world size ``w``
  (:func:`lay_out`) so that rank ``r``'s strided share of the order
  (:func:`protocol.plan.rank_part`, unchanged) holds each dataset's draws in their
  own order, spread through the share as a mechanical word of the dataset's share
  (:func:`_mechanical`): every run of consecutive samples of a part, so every batch
  of any size from any cursor, holds ``floor`` or ``ceil`` of its share of the run
  with two datasets; with more, the later datasets drift by up to one more sample.
  The ranks' words start at phases spread over one period, so ranks at one cursor
  have read each dataset's share of what they read together too.
- **Resumes.** What a job consumed of an epoch at one world size (a
  :class:`~protocol.plan.Segment`) is taken out of the order it read as
  :func:`protocol.plan.remaining_order` does, and the rest, each dataset's draws in
  their own order, is laid out again for the next world size
  (:func:`mixed_order`). Everything downstream of the order (the rank's part, its
  batches, a pool's strides, failover) is the plain stream's.

A mix of one dataset whose ``E`` is its size is a plain stream of it: the same
order, epoch for epoch.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np

from core.errors import InvalidArgument
from protocol.plan import LastBatch, Segment, epoch_order, remaining_order

__all__ = [
    "Mix",
    "check_epoch_length",
    "check_shares",
    "epoch_counts",
    "epoch_draws",
    "interleave",
    "lay_out",
    "mixed_order",
    "pass_order",
    "union_classes",
]


def epoch_counts(weights: Sequence[float], epoch_samples: int) -> tuple[int, ...]:
    """Samples each dataset contributes to an epoch of ``epoch_samples``: each
    weight's share by largest remainders (exact, ties to the earlier dataset), adding
    up to ``epoch_samples``.

    Raises:
        InvalidArgument: a weight that is not a positive finite number, or
            ``epoch_samples`` below 1.
    """
    _check_weights(weights)
    if epoch_samples < 1:
        raise InvalidArgument(f"epoch_samples: {epoch_samples} is not 1 or more")
    exact = [Fraction(w) for w in weights]
    total = sum(exact)
    quotas = [epoch_samples * w / total for w in exact]
    counts = [math.floor(q) for q in quotas]
    by_remainder = sorted(range(len(quotas)), key=lambda k: (-(quotas[k] - counts[k]), k))
    for k in by_remainder[:epoch_samples - sum(counts)]:
        counts[k] += 1
    return tuple(counts)


def check_epoch_length(epoch_samples: int, limit: int, mix_samples: int) -> None:
    """Refuse a mix's epoch longer than a daemon plans: its ``limit``
    (``--max-epoch-samples``) or the mix's datasets' ``mix_samples`` together,
    whichever is more (an epoch as long as the datasets it mixes, a loader's default,
    is always planned). Each epoch's order is built in memory, per stream: this bounds
    what one request makes a daemon spend. The daemon and the loader both check it.

    Raises:
        InvalidArgument: naming the field, its value and the limit.
    """
    allowed = max(limit, mix_samples)
    if epoch_samples > allowed:
        raise InvalidArgument(f"epoch_samples: {epoch_samples} is over this daemon's limit of {allowed} "
                              f"(--max-epoch-samples {limit}, or the mix's datasets' {mix_samples} samples together "
                              "where more): each epoch's order is built in memory")


def check_shares(names: Sequence[str], weights: Sequence[float], epoch_samples: int) -> tuple[int, ...]:
    """Each dataset's samples of an epoch (:func:`epoch_counts`), refusing a mix that
    would never read one of its datasets: a positive weight whose share of the epoch
    rounds to no sample. The daemon and the loader both check it.

    Raises:
        InvalidArgument: naming the dataset, its weight and the epoch's length (or
            what :func:`epoch_counts` refuses).
    """
    counts = epoch_counts(weights, epoch_samples)
    for k, count in enumerate(counts):
        if count == 0:
            raise InvalidArgument(f"mix[{k}].weight: {weights[k]:g} gives {names[k][:80]!r} no sample of an epoch of "
                                  f"{epoch_samples} (epoch_samples), so it would never be read: raise its weight "
                                  "or the epoch's length")
    return counts


def _check_weights(weights: Sequence[float]) -> None:
    if not weights:
        raise InvalidArgument("mix: no datasets")
    for k, weight in enumerate(weights):
        if not (math.isfinite(weight) and weight > 0):
            raise InvalidArgument(f"mix[{k}].weight: {weight!r} is not a positive finite number")


@dataclass(frozen=True)
class Mix:
    """The datasets of a mixed stream, as its plan needs them.

    Attributes:
        sizes: samples in each dataset's split, in the order given.
        weights: each dataset's weight (positive, finite; only their ratios count).
        epoch_samples: samples per epoch (``E``).

    Raises:
        InvalidArgument: no datasets, lengths that differ, an empty split, a weight
            that is not positive and finite, ``epoch_samples`` below 1.
    """

    sizes: tuple[int, ...]
    weights: tuple[float, ...]
    epoch_samples: int
    counts: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.weights):
            raise InvalidArgument(f"mix: {len(self.sizes)} sizes for {len(self.weights)} weights")
        _check_weights(self.weights)
        for k, size in enumerate(self.sizes):
            if size < 1:
                raise InvalidArgument(f"mix[{k}]: its split has no samples")
        object.__setattr__(self, "counts", epoch_counts(self.weights, self.epoch_samples))

    @classmethod
    def plain(cls, num_samples: int) -> Mix:
        """A plain stream of one split, as a mix of one."""
        return cls((num_samples,), (1.0,), num_samples)

    def __len__(self) -> int:
        """Samples per epoch (``E``)."""
        return self.epoch_samples

    @property
    def offsets(self) -> np.ndarray:
        """int64 ``[K + 1]``: where each dataset's samples start in the composite split."""
        return np.concatenate([[0], np.cumsum(self.sizes)]).astype(np.int64)

    def dataset_of(self, indices: np.ndarray) -> np.ndarray:
        """The dataset number of each composite index."""
        return np.searchsorted(self.offsets[1:], np.asarray(indices, dtype=np.int64), side="right")


def pass_order(size: int, seed: int, number: int, dataset: int, shuffle: bool) -> np.ndarray:
    """Pass ``number`` of dataset ``dataset`` (its position in the mix): a permutation
    of its ``size`` samples fixed by ``(seed, number, dataset)`` when ``shuffle``, else
    the stored order. The first dataset's pass ``p`` is a plain stream's epoch ``p``
    (:func:`protocol.plan.epoch_order`)."""
    if dataset == 0 or not shuffle:
        return epoch_order(size, seed, number, shuffle)
    rng = np.random.Generator(np.random.PCG64([seed & 0xFFFFFFFFFFFFFFFF, number, dataset]))
    return rng.permutation(size).astype(np.int64)


def epoch_draws(mix: Mix, seed: int, epoch: int, shuffle: bool) -> list[np.ndarray]:
    """Each dataset's samples of ``epoch`` (its local indices), in the order of its
    sequence of passes: positions ``epoch·n_k`` to ``(epoch+1)·n_k`` of it."""
    draws = []
    for k, (size, count) in enumerate(zip(mix.sizes, mix.counts)):
        start, end = epoch * count, (epoch + 1) * count
        pieces = []
        for number in range(start // size, -(-end // size)):
            lo, hi = max(start - number * size, 0), min(end - number * size, size)
            pieces.append(pass_order(size, seed, number, k, shuffle)[lo:hi])
        draws.append(np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64))
    return draws


def interleave(counts: Sequence[int]) -> np.ndarray:
    """The owner of each position of a run holding ``counts[k]`` elements of owner
    ``k``, spread evenly: the ``j``-th of owner ``k`` goes where its share puts it, at
    ``(j + 1/2) / counts[k]`` of the run, ties to the earlier owner (a dataset's draws
    dealt to the ranks)."""
    which = np.repeat(np.arange(len(counts)), counts)
    ranks = np.concatenate([np.arange(c) for c in counts]) if len(counts) else np.zeros(0, dtype=np.int64)
    sizes = np.repeat(np.asarray(counts, dtype=np.float64), counts)
    times = (2 * ranks + 1) / (2 * sizes)  # exact ties stay ties: each is one correctly rounded division
    return which[np.lexsort((which, times))]


def _run_starts(ranks: np.ndarray, world_size: int) -> np.ndarray:
    """For positions grouped by rank (``ranks`` sorted), each one's place in its rank's group."""
    first = np.searchsorted(ranks, np.arange(world_size))
    return np.arange(len(ranks)) - first[ranks]


def _mechanical(free: np.ndarray, rank_of: np.ndarray, per_rank: np.ndarray, count: int, total: int,
                world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Which of the ``free`` places (grouped by rank) one dataset of ``count`` of the
    ``total`` samples left takes, and how many it takes in each rank.

    In each rank it takes ``floor`` or ``ceil`` of its share of the rank's
    ``per_rank`` free places, spread as a mechanical word of slope ``count / total``:
    every run of ``L`` consecutive free places of a rank holds ``floor`` or ``ceil``
    of ``L·count/total`` of it. The ranks' words start at phases spread evenly over
    one period (rank ``r`` at ``(r + 1/2) / world_size``), each moved as little as its
    exact count needs, so ranks at one cursor have read the dataset's share of their
    places together too (what a resume at another world size leaves is then the
    dataset's share of the rest, give or take a sample). Integer arithmetic."""
    ranks = np.arange(world_size)
    product = per_rank * count
    floor, rho = product // total, product % total
    phase = total * (2 * ranks + 1) // (2 * world_size)  # the intercept, in 1/total of a sample
    edge = total - rho  # from here on the word holds one more in the rank's places
    up = (phase >= edge) & (rho > 0)
    change = count - int((floor + up).sum())
    if change > 0:  # the ranks nearest below their edge move up to it
        candidates = np.flatnonzero(~up & (rho > 0))
        up[candidates[np.lexsort((candidates, (edge - phase)[candidates]))[:change]]] = True
    elif change < 0:  # the ranks nearest above their edge move down below it
        candidates = np.flatnonzero(up)
        up[candidates[np.lexsort((candidates, (phase - edge)[candidates]))[:-change]]] = False
    intercept = np.where(up, np.maximum(phase, edge), np.minimum(phase, edge - 1))
    q = _run_starts(rank_of[free], world_size)
    c = intercept[rank_of[free]]
    takes = ((q + 1) * count + c) // total - (q * count + c) // total == 1
    return free[takes], floor + up


def lay_out(lists: Sequence[np.ndarray], world_size: int) -> np.ndarray:
    """An order of the concatenated ``lists`` whose strided shares (rank ``r`` of
    ``world_size`` takes every ``world_size``-th from ``r``, as
    :func:`protocol.plan.rank_part` does) are stratified.

    Each rank's share has the length :func:`protocol.plan.rank_part` gives it. Its
    places are dealt to the lists one after the other: list ``k`` takes ``floor`` or
    ``ceil`` of its share of each rank's places left (:func:`_mechanical`), spread
    evenly among them; its elements, in their own order, are dealt to the ranks by
    :func:`interleave` and fill its places in order. With two lists every run of
    ``L`` consecutive samples of a share holds ``floor`` or ``ceil`` of ``L·n_k/T`` of
    each; with more, the later lists' runs drift by up to one more sample per list.
    """
    lists = [np.asarray(x, dtype=np.int64) for x in lists]
    whole = np.concatenate(lists) if lists else np.zeros(0, dtype=np.int64)
    if len(lists) <= 1:
        return whole
    w, total = world_size, len(whole)
    base, extra = divmod(total, w)
    per_rank = base + (np.arange(w) < extra).astype(np.int64)
    rank_of = np.repeat(np.arange(w), per_rank)  # each place of the ranks' shares, rank after rank
    shares = np.empty(total, dtype=np.int64)
    free, left = np.arange(total, dtype=np.int64), total
    for items in lists:
        if not len(items):
            continue
        taken, counts = _mechanical(free, rank_of, per_rank, len(items), left, w)
        dealt = interleave(counts.tolist())
        shares[taken] = items[np.argsort(dealt, kind="stable")]  # rank after rank, each in the list's order
        free = np.setdiff1d(free, taken, assume_unique=True)
        per_rank, left = per_rank - counts, left - len(items)
    step = _run_starts(rank_of, w)
    order = np.empty(total, dtype=np.int64)
    order[step * w + rank_of] = shares
    return order


def _by_list(rest: np.ndarray, starts: np.ndarray) -> list[np.ndarray]:
    """``rest`` (slots of the concatenated draws) back into each dataset's list, in
    its own order (slots number a list's elements in order)."""
    which = np.searchsorted(starts[1:], rest, side="right")
    return [np.sort(rest[which == k]) for k in range(len(starts))]


def mixed_order(mix: Mix, seed: int, epoch: int, shuffle: bool, world_size: int,
                consumed: tuple[Segment, ...] = (), policy: LastBatch = LastBatch.DROP) -> np.ndarray:
    """The order (composite indices) of ``epoch`` that ``world_size`` ranks share out
    with :func:`protocol.plan.rank_part`: the epoch's draws laid out for the world
    size the epoch began at, less what each segment of ``consumed`` read, laid out
    again for the next world size each time.

    Raises:
        InvalidArgument: segments that cannot describe the epoch (see
            :func:`protocol.plan.check_segments`).
    """
    draws = epoch_draws(mix, seed, epoch, shuffle)
    if len(draws) == 1:
        order = draws[0]
        return remaining_order(order, consumed, policy) if consumed else order
    starts = np.concatenate([[0], np.cumsum(mix.counts)[:-1]]).astype(np.int64)
    slots = lay_out([start + np.arange(count) for start, count in zip(starts, mix.counts)],
                    consumed[0].world_size if consumed else world_size)
    for k, segment in enumerate(consumed):
        rest = remaining_order(slots, (segment,), policy)
        following = consumed[k + 1].world_size if k + 1 < len(consumed) else world_size
        slots = lay_out(_by_list(rest, starts), following)
    composite = np.concatenate([offset + d for offset, d in zip(mix.offsets[:-1], draws)])
    return composite[slots]


def union_classes(class_lists: Sequence[Sequence[str]]) -> tuple[list[str], list[np.ndarray]]:
    """The union of the datasets' class names, in the order the datasets are given
    (each name once, where it first appears), and for each dataset the map from its
    labels to the union's (int64 ``[its classes]``)."""
    union: dict[str, int] = {}
    maps = []
    for classes in class_lists:
        maps.append(np.array([union.setdefault(name, len(union)) for name in classes], dtype=np.int64))
    return list(union), maps
