"""Where a split's sample bytes come from, under :class:`shards.reader.SplitIndex`:
the local tars (:class:`LocalTars`), or a store through ranged GETs and the
node-local shard cache (:class:`shards.ranged.RemoteShards`). The reader checks what
a source gives (sizes, checksums) and raises the errors; a source only fetches, and
looks again when asked (a tar changed under its name, a cached copy gone bad).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple, Protocol

import numpy as np

from core.errors import DataError, Located
from shards.objects import StoreFault
from shards.tars import DEFAULT_RECHECK_S, OpenTar, TarFiles

__all__ = ["Extent", "Got", "LocalTars", "ShardBytes"]


class Extent(NamedTuple):
    """Bytes ``offset .. offset + size`` of shard ``shard`` (its number in the split)."""

    shard: int
    offset: int
    size: int


@dataclass
class Got:
    """What a source read for one extent: ``data`` (a new array of the extent's size,
    valid up to ``done`` bytes), whether it all came from memory (the page cache;
    False where unknown), what it was read from (``token``: a source tells by it
    whether a second look finds another file), and for a store that refuses the
    bytes for good, why (``refused``, and ``fault`` its kind; ``data`` is then not
    filled)."""

    data: np.ndarray
    done: int
    cached: bool = False
    token: object = None
    refused: str | None = None
    fault: StoreFault | None = None


class ShardBytes(Protocol):
    """A split's sample bytes, by shard number (the reader's view of a source)."""

    def where(self, shard: int) -> Path | Located:
        """The tar's path or URL, for messages."""
        ...

    def read(self, extents: Sequence[Extent]) -> list[Got]:
        """One :class:`Got` per extent, in order.

        Raises:
            DataError: a shard that cannot be read at all (names it).
        """
        ...

    def reread(self, extent: Extent, got: Got) -> Got | None:
        """``extent`` read again after ``got`` came up short or failed its checksum,
        from wherever its bytes are now; None when nothing has changed (a store's
        source reads again while the shard's heal window lasts: the reader asks
        until it gets None)."""
        ...

    def generation(self, shard: int) -> int: ...

    def on_changed(self, listener: Callable[[str], None]) -> None: ...

    def look_at(self, shard: int) -> None: ...

    def will_need(self, extents: Sequence[Extent]) -> None: ...


class LocalTars:
    """The tars of a split on a local file system, read with ``pread`` into fresh
    buffers (see :class:`shards.tars.TarFiles`).

    Args:
        root: the shard directory.
        shards: the tars' paths relative to it.
        recheck_s: the most time between two looks at a served tar's path.
        allowed_links: directories outside ``root`` its links may lead to.
    """

    def __init__(self, root: Path, shards: list[str], recheck_s: float = DEFAULT_RECHECK_S,
                 allowed_links: tuple[Path, ...] = ()) -> None:
        self._tars = TarFiles(root, shards, recheck_s, allowed_links)

    def where(self, shard: int) -> Path:
        return self._tars.path(shard)

    def read(self, extents: Sequence[Extent]) -> list[Got]:
        found = []
        for extent in extents:
            buffer = np.empty(extent.size, dtype=np.uint8)
            opened = self._tars.get(extent.shard)
            done, cached = opened.read_into(buffer, extent.offset)
            found.append(Got(buffer, done, cached, opened))
        return found

    def reread(self, extent: Extent, got: Got) -> Got | None:
        current: OpenTar = self._tars.recheck(extent.shard)  # changed under its name?
        if current is got.token:
            return None
        return Got(got.data, current.read_into(got.data, extent.offset)[0], False, current)

    def generation(self, shard: int) -> int:
        return self._tars.generation(shard)

    def on_changed(self, listener: Callable[[str], None]) -> None:
        self._tars.on_changed(listener)

    def look_at(self, shard: int) -> None:
        self._tars.get(shard)

    def will_need(self, extents: Sequence[Extent]) -> None:
        """Asks the kernel to start reading these extents from disk now."""
        if not hasattr(os, "posix_fadvise"):
            return
        for extent in extents:
            try:
                os.posix_fadvise(self._tars.get(extent.shard).fd, extent.offset, extent.size, os.POSIX_FADV_WILLNEED)
            except (OSError, DataError):
                continue  # only a hint; the read itself reports a missing file
