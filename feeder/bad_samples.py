"""Samples that cannot be served, and the daemon's error policy for them
(``feeder serve --on-error``).

A sample cannot be served when DALI fails to decode it, or when the index says it has
more pixels than the daemon's cap (a decompression bomb: refused before its bytes are
read). Under ``skip`` (the default) such a sample is replaced by a repeat of a good
sample of the same batch, marked as padding, so every rank still gets the same
number of batches; it is counted, named in ``GetStats`` and logged once. Under
``fail`` the stream ends with DATA_LOSS naming it (the daemon goes on serving).

A split's bad samples are remembered (:class:`BadSamples`), so a later batch, epoch or
stream replaces them before decoding, without a failed run, until their tar changes
(put right, or rewritten): then they are tried again.

Skipping has limits (:class:`FailureLimits`): a batch of which more than a share could
not be served, or an epoch in which more than a share of the rank's part could not,
ends the stream with DATA_LOSS naming the tars the failures came from, instead of
training on repeats of the few samples that still decode.

A mixed stream (:mod:`feeder.mixed_split`) keeps each dataset's own memory of its bad
samples (:class:`MixedBadSamples`: the one its plain streams share), counts them
under each dataset's name, and holds each dataset to the epoch limit of its own share
of the rank's part.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np

from core.bad_input import OnError
from core.errors import DataError
from feeder.mixed_split import MixedSplit, SplitView
from protocol.plan import BatchSlice
from shards.reader import SplitIndex

log = logging.getLogger(__name__)

__all__ = [
    "BadSamples",
    "FailureLimits",
    "MixedBadSamples",
    "OnError",
    "SampleFilter",
    "Screened",
    "TooManyBadSamples",
    "UnservableSample",
]


class UnservableSample(DataError):
    """A sample refused under ``fail``; the message names it and says why."""


class TooManyBadSamples(DataError):
    """More samples could not be served than a stream skips (:class:`FailureLimits`).

    Attributes:
        shards: the tars the failed samples came from, most failures first.
        failed: how many failed (in the batch, or in the epoch so far).
        limit: how many the stream would have skipped.
    """

    def __init__(self, message: str, shards: list[str], failed: int, limit: int) -> None:
        super().__init__(message)
        self.shards, self.failed, self.limit = shards, failed, limit


@dataclass(frozen=True)
class FailureLimits:
    """How much a stream skips before it ends with DATA_LOSS.

    Attributes:
        batch_fraction: largest share of one batch's samples that may be replaced.
        epoch_fraction: largest share of the rank's part of an epoch that may be
            replaced in that epoch (at least half a batch is always allowed).
        part_length: samples in the rank's part of an epoch.
        part_lengths: of a mix, each dataset's samples in that part (each is held to
            its own share); empty: one dataset.
    """

    batch_fraction: float = 0.5
    epoch_fraction: float = 0.01
    part_length: int = 0
    part_lengths: tuple[int, ...] = field(default=())

    def batch_limit(self, batch_size: int) -> int:
        return int(self.batch_fraction * batch_size)

    def epoch_limit(self, batch_size: int, dataset: int = 0) -> int:
        part = self.part_lengths[dataset] if self.part_lengths else self.part_length
        return max(int(self.epoch_fraction * part), batch_size // 2)


class BadSamples:
    """The samples of one split that cannot be served, by index, with the reason.
    Thread-safe; shared by every stream of the split.

    Args:
        dataset: the dataset's name (for messages).
        split: the split's index (keys and image sizes).
        max_pixels: largest width x height served.
        on_found: called once per bad sample with its name (``dataset/split/key:
            reason``), e.g. to list it in ``GetStats``.
    """

    def __init__(
        self, dataset: str, split: SplitIndex, max_pixels: int, on_found: Callable[[str], None] = lambda _: None
    ) -> None:
        self.dataset = dataset
        self.split = split
        self.max_pixels = max_pixels
        self._on_found = on_found
        self._reasons: dict[int, str] = {}
        self._lock = threading.Lock()
        pixels = split.widths.astype(np.int64) * split.heights.astype(np.int64)
        self._oversized = frozenset(int(i) for i in np.flatnonzero(pixels > max_pixels))
        split.on_shard_changed(self._forget)

    def name(self, index: int) -> str:
        """``dataset/split/key`` of sample ``index``."""
        return f"{self.dataset}/{self.split.split}/{self.split.keys[index]}"

    def reason(self, index: int) -> str | None:
        """Why sample ``index`` cannot be served, or None as far as is known."""
        with self._lock:
            found = self._reasons.get(index)
        if found is None and index in self._oversized:
            width, height = int(self.split.widths[index]), int(self.split.heights[index])
            found = f"{width}x{height} pixels, over max_pixels {self.max_pixels}"
        return found

    def known(self, indices: np.ndarray) -> dict[int, str]:
        """Position -> reason of each sample of ``indices`` known to be bad (their
        tars looked at first: bad samples are not read, so a tar put right would
        otherwise go unnoticed)."""
        with self._lock:
            if not self._reasons and not self._oversized:  # the usual case: nothing to look up
                return {}
            remembered = [int(i) for i in indices if int(i) in self._reasons]
        for shard in {self.split.shard_of(i) for i in remembered}:
            self.split.look_at(shard)  # at most once per the split's recheck_s
        return {pos: reason for pos, i in enumerate(indices) if (reason := self.reason(int(i))) is not None}

    def _forget(self, shard: str) -> None:
        """Tar ``shard`` changed: its samples are tried again."""
        with self._lock:
            forgotten = [i for i in self._reasons if self.split.shard_of(i) == shard]
            for i in forgotten:
                del self._reasons[i]
        if forgotten:
            log.warning("%s/%s: %s changed; its %d bad samples are tried again", self.dataset, self.split.split,
                        shard, len(forgotten))

    def add(self, index: int, reason: str) -> None:
        """Remember sample ``index`` as bad; the first time, log it and report it."""
        with self._lock:
            if index in self._reasons:
                return
            self._reasons[index] = reason
        name = self.name(index)
        log.warning("%s: %s; replaced by a repeat of another sample from now on (--on-error skip)", name, reason)
        self._on_found(f"{name}: {reason}")

    def __len__(self) -> int:
        with self._lock:
            return len(self._reasons)

    def dataset_of(self, index: int) -> str:
        """The dataset sample ``index`` is of (for messages and counters)."""
        return self.dataset

    def groups(self, indices: np.ndarray) -> np.ndarray:
        """The dataset number of each sample (0: one dataset)."""
        return np.zeros(len(indices), dtype=np.int64)


class MixedBadSamples:
    """A mix's memory of bad samples by composite index: each dataset's own
    :class:`BadSamples` (shared with the plain streams of its split).

    Args:
        parts: each dataset's, in the mix's order.
        split: the mix's composite split.
    """

    def __init__(self, parts: Sequence[BadSamples], split: MixedSplit) -> None:
        self.parts = list(parts)
        self.split = split
        self.dataset = "+".join(p.dataset for p in parts)

    def _part(self, index: int) -> tuple[BadSamples, int]:
        k = int(self.split.part_of(np.array([index]))[0])
        return self.parts[k], index - int(self.split.offsets[k])

    def dataset_of(self, index: int) -> str:
        return self._part(index)[0].dataset

    def groups(self, indices: np.ndarray) -> np.ndarray:
        return self.split.part_of(indices)

    def reason(self, index: int) -> str | None:
        part, local = self._part(index)
        return part.reason(local)

    def add(self, index: int, reason: str) -> None:
        part, local = self._part(index)
        part.add(local, reason)

    def known(self, indices: np.ndarray) -> dict[int, str]:
        """Position -> reason of each known bad sample of ``indices`` (see :meth:`BadSamples.known`)."""
        rows, found = np.asarray(indices, dtype=np.int64), {}
        which = self.groups(rows)
        for k in np.unique(which):
            positions = np.flatnonzero(which == k)
            local = self.parts[int(k)].known(rows[positions] - self.split.offsets[int(k)])
            found.update({int(positions[p]): reason for p, reason in local.items()})
        return dict(sorted(found.items()))

    def __len__(self) -> int:
        return sum(len(p) for p in self.parts)


@dataclass(frozen=True)
class Screened:
    """A batch as it will be decoded: replaced samples' indices point at their donors
    and are marked in ``padding``; ``failed`` lists the replaced samples' indices."""

    batch: BatchSlice
    failed: tuple[int, ...] = ()


class SampleFilter:
    """One stream's view of its split's bad samples, under its error policy.

    Args:
        bad: the split's bad samples (a mix's: :class:`MixedBadSamples`).
        on_error: ``skip`` or ``fail``.
        limits: how much ``skip`` skips.
    """

    def __init__(self, bad: BadSamples | MixedBadSamples, on_error: OnError,
                 limits: FailureLimits = FailureLimits()) -> None:
        self.bad = bad
        self.on_error = on_error
        self.limits = limits
        self._good: int | None = None  # a sample this stream has decoded: the donor of last resort
        self._epoch = -1
        self._epoch_failed: list[int] = []  # samples replaced in the epoch so far

    @property
    def split(self) -> SplitView:
        """The samples screened."""
        return self.bad.split

    def failed_by_dataset(self, failed: Sequence[int]) -> Counter[str]:
        """How many of ``failed`` are of each dataset."""
        return Counter(self.bad.dataset_of(int(i)) for i in failed)

    def screen(self, batch: BatchSlice) -> Screened:
        """``batch`` with its known bad samples replaced, before anything is read.

        Raises:
            UnservableSample: under ``fail``, a sample over the pixel cap.
        """
        known = self.bad.known(batch.indices)
        if known and self.on_error is OnError.FAIL:
            pos, reason = next(iter(known.items()))
            raise UnservableSample(f"{self.split.split}/{self.split.keys[int(batch.indices[pos])]}: {reason}")
        return self._replaced(Screened(batch), list(known), known)

    def replace(self, screened: Screened, reasons: Mapping[int, str]) -> Screened:
        """``screened`` after the samples at the positions of ``reasons`` failed to
        be read or decoded: they are remembered as bad (with the reason each) and
        replaced.

        Raises:
            TooManyBadSamples: more of the batch failed than ``limits`` allow.
        """
        return self._replaced(screened, list(reasons), reasons)

    def delivered(self, screened: Screened) -> None:
        """``screened`` decoded: its samples can stand in for bad ones later, and its
        failures count against the epoch's limit.

        Raises:
            TooManyBadSamples: more of the epoch failed than ``limits`` allow.
        """
        batch = screened.batch
        self._good = int(batch.indices[~batch.padding][0]) if (~batch.padding).any() else self._good
        if batch.epoch != self._epoch:
            self._epoch, self._epoch_failed = batch.epoch, []
        self._epoch_failed.extend(screened.failed)
        if not self._epoch_failed:
            return
        groups = self.bad.groups(np.asarray(self._epoch_failed, dtype=np.int64))
        for k in np.unique(groups):  # each dataset of a mix against its own share of the part
            failed = [i for i, g in zip(self._epoch_failed, groups) if g == k]
            limit = self.limits.epoch_limit(len(batch.indices), int(k))
            if len(failed) > limit:
                raise self._too_many(failed, limit, f"in epoch {batch.epoch} so far")

    def _replaced(self, screened: Screened, positions: list[int], reasons: Mapping[int, str]) -> Screened:
        if not positions:
            return screened
        batch = screened.batch
        bad = {int(batch.indices[pos]) for pos in positions}
        for pos, reason in reasons.items():
            self.bad.add(int(batch.indices[pos]), reason)
        # Every slot holding a bad sample goes, also where it stood in for another.
        hit = np.isin(batch.indices, list(bad))
        # A slot that was padding already repeats a sample counted where it stands.
        failed = screened.failed + tuple(int(i) for i in batch.indices[hit & ~batch.padding])
        limit = self.limits.batch_limit(len(batch.indices))
        if len(failed) > limit:
            raise self._too_many(list(failed), limit, f"of a batch of {len(batch.indices)}")
        indices, padding = batch.indices.copy(), batch.padding | hit
        indices[hit] = self._donor(batch.indices, hit)
        return Screened(replace(batch, indices=indices, padding=padding), failed)

    def _too_many(self, failed: list[int], limit: int, where: str) -> TooManyBadSamples:
        split = self.split
        shards = Counter(str(split.tar(i)) for i in failed)
        named = [shard for shard, _ in shards.most_common()]
        first = self.bad.reason(failed[0]) or "cannot be served"
        return TooManyBadSamples(
            f"{self.bad.dataset_of(failed[0])}/{split.split}: {len(failed)} samples {where} could not be served (more "
            f"than {limit}), from {', '.join(named[:3])}"
            f"{' and more' if len(named) > 3 else ''}: the shard is damaged or changed "
            f"(first: {split.keys[failed[0]]}: {first})", named, len(failed), limit)

    def _donor(self, indices: np.ndarray, hit: np.ndarray) -> int:
        """A sample to repeat: a good one of the batch, else one this stream decoded,
        else the first of the split not known to be bad (decoding will tell)."""
        for index in indices[~hit]:
            if self.bad.reason(int(index)) is None:
                return int(index)
        if self._good is not None and self.bad.reason(self._good) is None:
            return self._good
        for index in range(len(self.split)):
            if self.bad.reason(index) is None:
                return index
        raise DataError(f"{self.bad.dataset}/{self.split.split}: no sample of the split can be served")
