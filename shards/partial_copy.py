"""A shard's copy while the node cache assembles it: one file under ``partial/``, its
size from the start, and the byte ranges that have landed in it.

Bytes land at their own offsets, from two writers: the cache's background download,
and the ranged reads of the shard's samples that batches made before it started (their
bytes are the object's too, so the download does not fetch them again: a cold shard's
bytes come from the store once). Once the download runs, reads of the shard wait for
it instead of fetching (a request costs the store about as much CPU as a MiB of a
download does), up to a bound. Reads of samples whose bytes have landed are served
from the file. What lands is not trusted until the whole file has matched the manifest's
sha256; before that only reads checked against per-sample checksums (an index of
version 3) use it.
"""

from __future__ import annotations

import bisect
import errno
import hashlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from core.errors import FeederError

__all__ = ["LEAD_BYTES", "THROUGH_BYTES", "PartialCopy"]

# Gaps closer than this are fetched in one request, the landed bytes between them
# again: the tar headers between samples read are smaller, and a request costs the
# store more than a few KiB do.
THROUGH_BYTES = 16 << 10
# Bytes just ahead of the running download: reads wait for them rather than fetch
# them (about 50 ms of a download; further ahead, a read fetches its own bytes).
LEAD_BYTES = 16 << 20
_COMING_WAIT_S = 60.0  # the longest the download waits for a read under way of bytes it needs


class PartialCopy:
    """The file ``path`` of ``size`` bytes, written by range.

    Raises:
        OSError: the file cannot be made (its directory gone, the disk full).
    """

    def __init__(self, path: Path, size: int) -> None:
        self.path, self.size = path, size
        self._fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        self._changed = threading.Condition()  # bytes landed, a fetch ended, the copy closed
        self._starts: list[int] = []  # landed ranges: sorted, disjoint, not touching
        self._ends: list[int] = []
        self._coming: list[tuple[int, int]] = []  # ranges being fetched now
        self._front: int | None = None  # the download runs: it will fetch what is past here
        self._closed = False
        self.failed: OSError | None = None  # a write failed (a full disk): the copy cannot be finished
        try:
            os.ftruncate(self._fd, size)
        except OSError:
            os.close(self._fd)
            raise

    def add(self, start: int, data: memoryview | bytes) -> int:
        """``data`` is the object's bytes from ``start``: written where they are not yet
        (a write that fails marks the copy failed; the reader that brought them does
        not fail). Returns the bytes written."""
        end, written = min(start + len(data), self.size), 0
        with self._changed:
            if self._closed or self.failed is not None:
                return 0
            for lo, hi in self._gaps(start, end):
                try:
                    _write_all(self._fd, memoryview(data)[lo - start:hi - start], lo)
                except OSError as e:
                    self.failed = e
                    break
                self._landed(lo, hi)
                written += hi - lo
            self._changed.notify_all()
        return written

    def has(self, start: int, end: int) -> bool:
        """Whether bytes ``start .. end`` have landed."""
        with self._changed:
            return self._has(start, end)

    def gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        """The ranges of ``start .. end`` that have not landed, in order."""
        with self._changed:
            return self._gaps(start, end)

    @contextmanager
    def _claimed(self, start: int, end: int, *, first: bool = False, past_soon: bool = False,
                 but_coming: bool = True) -> Iterator[list[tuple[int, int]]]:
        """The requests that fetch what of ``start .. end`` has not landed (``but_coming``:
        nor is being fetched; ``past_soon``: less what the running download fetches
        next; ``first``: only the first of them), marked as being fetched while the
        block runs. Found and marked in one step: a read and the download looking at
        once would otherwise both find the same bytes missing and neither under way,
        and both fetch them. Gaps closer than ``THROUGH_BYTES`` are joined into one,
        never across bytes being fetched, which would then come from the store twice."""
        with self._changed:
            gaps = self._gaps(start, end)
            pieces = _merged(_without(gaps, self._coming) if but_coming else gaps, self._coming)
            if past_soon and self._front is not None:
                soon = (self._front, self._front + LEAD_BYTES)
                pieces = [piece for lo, hi in pieces for piece in ((lo, min(hi, soon[0])), (max(lo, soon[1]), hi))
                          if piece[0] < piece[1]]
            pieces = pieces[:1] if first else pieces
            self._coming += pieces
        try:
            yield pieces
        finally:
            self._arrived(pieces)

    def fill(self, start: int, end: int, fetch: Callable[[int, int], memoryview], wait_s: float) -> bytes | None:
        """Bytes ``start .. end`` for a read: fetching (``fetch(start, length)``) only
        what has not landed, is not being fetched, and the download will not fetch,
        and waiting at most ``wait_s`` for the rest; None where they are not all there
        then (a fetch failed, the object is shorter, the copy was finished or failed,
        the download is slow): fetch them whole."""
        with self._claimed(start, end, past_soon=True) as pieces:  # what the download brings soon: waited for
            for lo, hi in pieces:
                self.add(lo, fetch(lo, hi - lo))
        return self.landed(start, end, wait_s)

    def landed(self, start: int, end: int, wait_s: float) -> bytes | None:
        """Bytes ``start .. end`` if they have landed, or land within ``wait_s``."""
        buffer = np.empty(end - start, np.uint8)
        return buffer.tobytes() if self.read_into(buffer, start, wait_s) else None

    @contextmanager
    def coming(self, start: int, end: int) -> Iterator[None]:
        """Bytes ``start .. end`` are being fetched while the block runs: reads of
        them wait for them (:meth:`read_into`) instead of fetching them too."""
        with self._changed:
            self._coming.append((start, end))
        try:
            yield
        finally:
            self._arrived([(start, end)])

    def _arrived(self, pieces: list[tuple[int, int]]) -> None:
        """``pieces`` are no longer being fetched (landed, or their fetch failed)."""
        with self._changed:
            for piece in pieces:
                self._coming.remove(piece)
            self._changed.notify_all()

    def read_into(self, buffer: np.ndarray, offset: int, wait_s: float = 0.0) -> bool:
        """Fills ``buffer`` from ``offset`` if those bytes have landed and the copy is
        still open, or land within ``wait_s`` (being fetched, or ahead of the running
        download); False otherwise (read them elsewhere)."""
        end, deadline = offset + len(buffer), time.monotonic() + wait_s
        with self._changed:
            while not self._closed and not self._has(offset, end) and self._awaited(offset, end):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            if self._closed or not self._has(offset, end):
                return False
            return os.preadv(self._fd, [buffer.data], offset) == len(buffer)

    def complete(self, fetch: Callable[[int, int], memoryview], chunk_bytes: int,
                 paced: Callable[[int], None], leads: bool = True) -> str:
        """Fetches what has not landed (``fetch(start, length)``, in requests of at most
        ``chunk_bytes``, ``paced(bytes fetched so far)`` after each chunk; ``leads``:
        reads wait for it rather than fetch what it will, False where it is throttled) and returns
        the sha256 of the whole, hashed in order as it goes: a chunk fetched whole from
        its bytes in memory, one that had landed bytes read back from the page cache.

        Raises:
            FeederError: the store answered fewer bytes than asked for.
            OSError: a write to the copy failed.
        """
        digest, fetched = hashlib.sha256(), 0
        try:
            for start in range(0, self.size, chunk_bytes):
                end = min(start + chunk_bytes, self.size)
                with self._changed:
                    self._front = start if leads else None
                whole, at = None, start
                # One gap at a time, looked at afresh: reads under way bring the rest.
                while True:
                    with self._claimed(at, end, first=True) as pieces:
                        if not pieces:
                            break
                        lo, hi = pieces[0]
                        data, written = self._fetched(fetch, lo, hi)
                    fetched += len(data)
                    # The file holds these very bytes only where this fetch wrote them all.
                    whole = data if (lo, hi) == (start, end) and written == len(data) else None
                    at = hi
                with self._changed:  # until no read of this chunk's bytes is under way
                    self._changed.wait_for(lambda: not self._fetching(start, end), _COMING_WAIT_S)
                with self._claimed(start, end, but_coming=False) as pieces:  # a read that failed or was dropped
                    for lo, hi in pieces:
                        fetched += len(self._fetched(fetch, lo, hi)[0])
                        whole = None
                if self.failed is not None:
                    raise self.failed
                digest.update(whole if whole is not None else os.pread(self._fd, end - start, start))
                paced(fetched)
        finally:
            with self._changed:
                self._front = None
                self._changed.notify_all()
        return digest.hexdigest()

    def _fetched(self, fetch: Callable[[int, int], memoryview], lo: int, hi: int) -> tuple[memoryview, int]:
        """Bytes ``lo .. hi`` (claimed) fetched and landed; with the bytes of them written now."""
        data = fetch(lo, hi - lo)
        if len(data) != hi - lo:
            raise FeederError(f"{len(data)} bytes at offset {lo}, {hi - lo} asked for")
        return data, self.add(lo, data)

    def sync(self) -> None:
        os.fsync(self._fd)

    def close(self) -> None:
        """No more writes or reads (the file is renamed into place, or removed)."""
        with self._changed:
            if not self._closed:
                self._closed = True
                os.close(self._fd)
            self._changed.notify_all()

    def _awaited(self, start: int, end: int) -> bool:
        """Whether bytes of ``start .. end`` are on their way: being fetched, or ahead
        of the running download."""
        soon = self._front is not None and end > self._front and start < self._front + LEAD_BYTES
        return soon or self._fetching(start, end)

    def _fetching(self, start: int, end: int) -> bool:
        """Whether a fetch of bytes within ``start .. end`` is under way."""
        return any(s < end and start < n for s, n in self._coming)

    def _has(self, start: int, end: int) -> bool:
        i = bisect.bisect_right(self._starts, start) - 1
        return i >= 0 and self._ends[i] >= end

    def _gaps(self, start: int, end: int) -> list[tuple[int, int]]:
        gaps, at = [], start
        i = max(bisect.bisect_right(self._starts, start) - 1, 0)
        while at < end and i < len(self._starts):
            if self._ends[i] <= at:
                i += 1
                continue
            if self._starts[i] >= end:
                break
            if self._starts[i] > at:
                gaps.append((at, self._starts[i]))
            at = max(at, self._ends[i])
            i += 1
        if at < end:
            gaps.append((at, end))
        return gaps

    def _landed(self, start: int, end: int) -> None:
        """Records ``start .. end`` (a gap: it overlaps no landed range), merged with
        the ranges it touches."""
        i = bisect.bisect_left(self._starts, start)
        if i > 0 and self._ends[i - 1] == start:
            i -= 1
            start = self._starts[i]
            del self._starts[i], self._ends[i]
        if i < len(self._starts) and self._starts[i] == end:
            end = self._ends[i]
            del self._starts[i], self._ends[i]
        self._starts.insert(i, start)
        self._ends.insert(i, end)


def _write_all(fd: int, data: memoryview, offset: int) -> None:
    """``data`` at ``offset``, however many writes it takes (a short write on a disk
    filling up is followed by ENOSPC).

    Raises:
        OSError: a write failed.
    """
    while data:
        done = os.pwrite(fd, data, offset)
        if done <= 0:
            raise OSError(errno.ENOSPC, "no space left on device")
        data, offset = data[done:], offset + done


def _without(gaps: list[tuple[int, int]], ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``gaps`` less the bytes of ``ranges``."""
    for lo, hi in sorted(ranges):
        gaps = [piece for a, b in gaps for piece in ((a, min(b, lo)), (max(a, hi), b)) if piece[0] < piece[1]]
    return gaps


def _merged(gaps: list[tuple[int, int]], under_way: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``gaps`` with those closer than ``THROUGH_BYTES`` joined into one range, unless
    bytes between them are being fetched (``under_way``): fetched again, those would
    come from the store twice."""
    merged: list[tuple[int, int]] = []
    for lo, hi in gaps:
        between = merged[-1][1] if merged else lo
        if merged and lo - between < THROUGH_BYTES and not any(s < lo and between < n for s, n in under_way):
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    return merged
