"""The samples a stream reads: one split (:class:`shards.reader.SplitIndex`), or a
mix's splits seen as one composite split (:class:`MixedSplit`).

A mix's composite index ``offsets[k] + j`` is sample ``j`` of its ``k``-th dataset
(:class:`protocol.mix.Mix`): the plan hands out composite indices, and everything a
producer does with them (keys, labels, image sizes, reads, read-ahead, half-scale
copies) goes to that dataset's own split. Its labels index the union of the datasets'
class names (:func:`protocol.mix.union_classes`); its keys are ``NAME/key``. What a
dataset's split raises about its samples (a changed checksum, a store refusing them)
is raised again with composite indices and keys, so the error policy replaces the
right samples.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar

import numpy as np

from core.errors import Located, SampleCorrupt, SamplesUnreadable, Unreadable
from shards.reader import SplitIndex, Windows

__all__ = ["MixedPart", "MixedSplit", "SplitView"]


class SplitView(Protocol):
    """What a stream reads its samples through (a :class:`SplitIndex` is one)."""

    @property
    def split(self) -> str: ...

    @property
    def labels(self) -> np.ndarray: ...

    @property
    def widths(self) -> np.ndarray: ...

    @property
    def heights(self) -> np.ndarray: ...

    @property
    def uncached_reads(self) -> int: ...

    @property
    def keys(self) -> Sequence[str]: ...

    def __len__(self) -> int: ...

    def tar(self, index: int) -> Path | Located: ...

    def read_many(self, indices: Sequence[int] | np.ndarray, half: np.ndarray | None = None) -> list[np.ndarray]: ...

    def read_windows(self, indices: Sequence[int] | np.ndarray, boxes: np.ndarray, image_size: int) -> Windows: ...

    def drop_copies(self, indices: Sequence[int] | np.ndarray) -> None: ...

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None: ...


@dataclass(frozen=True)
class MixedPart:
    """One dataset of a mix: its name, its split and the map from its labels to the
    union of the mix's classes."""

    name: str
    split: SplitIndex
    labels: np.ndarray


_Read = TypeVar("_Read")


def _composite(part: MixedPart, offset: int, refused: list[Unreadable], read: Callable[[], _Read]) -> _Read | None:
    """``read()`` of one dataset's samples, what it raises about them said in composite
    indices and keys (``NAME/key``): a changed sample raised again, samples a store
    refused added to ``refused`` (then None), so the error policy replaces the right
    samples whichever read met them."""
    try:
        return read()
    except SampleCorrupt as e:
        raise SampleCorrupt(e.path, f"{part.name}/{e.key}", e.index + offset, e.half) from e
    except SamplesUnreadable as e:
        refused += [Unreadable(s.url, f"{part.name}/{s.key}", s.index + offset, s.half, s.reason) for s in e.samples]
        return None


class _Keys(Sequence[str]):
    """``NAME/key`` of each composite index, made when asked."""

    def __init__(self, mixed: MixedSplit) -> None:
        self._mixed = mixed

    def __len__(self) -> int:
        return len(self._mixed)

    def __getitem__(self, index):  # type: ignore[no-untyped-def]  # Sequence's overloads; ints only here
        part, local = self._mixed.locate(int(index))
        return f"{part.name}/{part.split.keys[local]}"


class MixedSplit:
    """Several datasets' splits as one, by composite index (see the module doc).

    Args:
        parts: the mix's datasets, in its order.
    """

    def __init__(self, parts: Sequence[MixedPart]) -> None:
        self.parts = list(parts)
        self.split = parts[0].split.split
        self.offsets = np.concatenate([[0], np.cumsum([len(p.split) for p in parts])]).astype(np.int64)
        self._ends = [int(end) for end in self.offsets[1:]]  # for one index at a time (bisect: 0.1 us)
        self.labels = np.concatenate([p.labels[p.split.labels] for p in parts]).astype(np.int64)
        self.widths = np.concatenate([p.split.widths for p in parts])
        self.heights = np.concatenate([p.split.heights for p in parts])
        self.keys: Sequence[str] = _Keys(self)

    def __len__(self) -> int:
        return int(self.offsets[-1])

    @property
    def uncached_reads(self) -> int:
        """Reads not served from the page cache alone, of every dataset's split."""
        return sum(p.split.uncached_reads for p in self.parts)

    def locate(self, index: int) -> tuple[MixedPart, int]:
        """The dataset of composite ``index`` and the sample's index in its split."""
        k = bisect.bisect_right(self._ends, index)
        return self.parts[k], index - int(self.offsets[k])

    def part_of(self, indices: np.ndarray) -> np.ndarray:
        """The dataset number of each composite index."""
        return np.searchsorted(self.offsets[1:], np.asarray(indices, dtype=np.int64), side="right")

    def _groups(self, indices: Sequence[int] | np.ndarray) -> list[tuple[int, np.ndarray]]:
        """(dataset number, positions in ``indices``) of each dataset they hold."""
        which = self.part_of(np.asarray(indices, dtype=np.int64))
        return [(int(k), np.flatnonzero(which == k)) for k in np.unique(which)]

    def tar(self, index: int) -> Path | Located:
        """The tar (or object) holding composite sample ``index``."""
        part, local = self.locate(index)
        return part.split.tar(local)

    def read_many(self, indices: Sequence[int] | np.ndarray, half: np.ndarray | None = None) -> list[np.ndarray]:
        """Each sample's bytes, in order, read from its dataset's split (see
        :meth:`SplitIndex.read_many`; errors name composite indices and keys)."""
        rows = np.asarray(indices, dtype=np.int64)
        found: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(rows)
        refused: list[Unreadable] = []
        for k, positions in self._groups(rows):
            part, offset = self.parts[k], int(self.offsets[k])
            got = _composite(part, offset, refused, lambda: part.split.read_many(
                rows[positions] - offset, None if half is None else half[positions]))
            if got is None:
                continue
            for position, jpeg in zip(positions, got):
                found[position] = jpeg
        if refused:
            raise SamplesUnreadable(refused)
        return found

    def read_windows(self, indices: Sequence[int] | np.ndarray, boxes: np.ndarray, image_size: int) -> Windows:
        """:meth:`SplitIndex.read_windows` of each dataset's samples, in order."""
        rows, boxes = np.asarray(indices, dtype=np.int64), np.asarray(boxes)
        jpegs: list[np.ndarray] = [np.empty(0, dtype=np.uint8)] * len(rows)
        out_boxes = np.empty((len(rows), 4), dtype=np.int32)
        copies = np.zeros(len(rows), dtype=bool)
        refused: list[Unreadable] = []
        for k, positions in self._groups(rows):
            part, offset = self.parts[k], int(self.offsets[k])
            got = _composite(part, offset, refused, lambda: part.split.read_windows(
                rows[positions] - offset, boxes[positions], image_size))
            if got is None:
                continue
            for position, jpeg in zip(positions, got.jpegs):
                jpegs[position] = jpeg
            out_boxes[positions], copies[positions] = got.boxes, got.from_copies
        if refused:
            raise SamplesUnreadable(refused)
        return Windows(jpegs, out_boxes, copies)

    def drop_copies(self, indices: Sequence[int] | np.ndarray) -> None:
        """Read these samples from their images from now on (in their own splits)."""
        rows = np.asarray(indices, dtype=np.int64)
        for k, positions in self._groups(rows):
            self.parts[k].split.drop_copies(rows[positions] - self.offsets[k])

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None:
        """Start fetching these samples now (each from its own split)."""
        rows = np.asarray(indices, dtype=np.int64)
        for k, positions in self._groups(rows):
            self.parts[k].split.will_need(rows[positions] - self.offsets[k])
