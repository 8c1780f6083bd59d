"""A shard's copy being assembled: bytes landing by range from two writers, reads of
what has landed, a read waiting for bytes under way, and the download that fetches
only the gaps and hashes the whole in order."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from contextlib import ExitStack
from pathlib import Path

import numpy as np
import pytest

from core.errors import FeederError
from shards.partial_copy import PartialCopy

OBJECT = np.random.default_rng(0).integers(0, 256, 1 << 20, dtype=np.uint8).tobytes()


class _Store:
    """The object's bytes by range, with each request recorded."""

    def __init__(self, data: bytes = OBJECT) -> None:
        self.data, self.asked = data, []

    def __call__(self, start: int, length: int) -> memoryview:
        self.asked.append((start, length))
        return memoryview(self.data[start:start + length])


def _copy(tmp_path: Path, size: int = len(OBJECT)) -> PartialCopy:
    return PartialCopy(tmp_path / "s.part", size)


def test_landed_ranges_merge_and_the_gaps_are_what_is_left(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    for start, end in [(100, 200), (300, 400), (200, 300), (1000, 1100)]:
        assert copy.add(start, OBJECT[start:end]) == end - start
    assert copy.has(100, 400) and not copy.has(99, 400) and not copy.has(350, 1000)
    assert copy.gaps(0, 1200) == [(0, 100), (400, 1000), (1100, 1200)]
    assert copy.add(150, OBJECT[150:450]) == 50  # only what had not landed is written
    assert sum(hi - lo for lo, hi in copy.gaps(0, copy.size)) == copy.size - (350 + 100)
    copy.close()


def test_reads_are_served_only_from_landed_bytes(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    copy.add(4096, OBJECT[4096:8192])
    buffer = np.empty(1000, np.uint8)
    assert copy.read_into(buffer, 5000) and buffer.tobytes() == OBJECT[5000:6000]
    assert not copy.read_into(buffer, 7500)  # runs past what landed
    copy.close()
    assert not copy.read_into(buffer, 5000)  # closed: read it elsewhere


def test_a_read_of_bytes_under_way_waits_for_them(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    buffer = np.empty(100, np.uint8)

    def download() -> None:
        with copy.coming(0, 65536):
            time.sleep(0.2)
            copy.add(0, OBJECT[:65536])

    fetching = threading.Thread(target=download)
    fetching.start()
    time.sleep(0.05)
    assert copy.read_into(buffer, 1000, wait_s=5) and buffer.tobytes() == OBJECT[1000:1100]
    fetching.join()
    assert not copy.read_into(np.empty(100, np.uint8), 70000, wait_s=5)  # nothing under way there: no wait
    copy.close()


def test_the_download_fetches_only_the_gaps_and_hashes_the_whole(tmp_path: Path) -> None:
    copy, store = _copy(tmp_path), _Store()
    landed = [(10_000, 60_000), (60_000 + 1024, 200_000), (700_000, 750_000)]  # a header-sized gap at 60,000
    for start, end in landed:
        copy.add(start, OBJECT[start:end])
    sha256 = copy.complete(store, 256 << 10, lambda fetched: None)
    copy.close()
    assert sha256 == hashlib.sha256(OBJECT).hexdigest() and (tmp_path / "s.part").read_bytes() == OBJECT
    fetched = sum(length for _, length in store.asked)
    assert fetched <= len(OBJECT) - 190_000 + 1024 * 2  # what had landed was not fetched again
    assert (10_000, 1024) not in store.asked  # the small gap was not a request of its own


def test_the_download_fetches_no_byte_a_read_is_fetching_though_the_gaps_about_it_are_small(tmp_path: Path) -> None:
    # Reads of a small shard's samples under way as its download starts (a busy machine):
    # the gaps between them are under THROUGH_BYTES, and joined across them the download
    # fetched those samples' bytes too, so the shard came from the store twice.
    copy, store = _copy(tmp_path, 80_000), _Store()
    reads = [(5_000, 10_000), (20_000, 25_000), (40_000, 45_000)]
    with ExitStack() as requests_out:
        for start, end in reads:
            requests_out.enter_context(copy.coming(start, end))  # what fill() holds while its request is out
        downloading = threading.Thread(target=copy.complete, args=(store, 4 << 20, lambda fetched: None))
        downloading.start()
        assert _waited(lambda: len(store.asked) == len(reads) + 1)  # the gaps about the reads
        for start, end in reads:
            copy.add(start, OBJECT[start:end])
    downloading.join(10)
    assert not downloading.is_alive()
    assert sum(length for _, length in store.asked) == 80_000 - 15_000
    assert not any(s < end and start < s + n for s, n in store.asked for start, end in reads)
    copy.close()


def _waited(done, timeout_s: float = 10) -> bool:
    deadline = time.monotonic() + timeout_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.01)
    return done()


def test_a_short_answer_or_a_failed_write_stops_the_download(tmp_path: Path) -> None:
    copy = _copy(tmp_path)
    with pytest.raises(FeederError, match="bytes at offset 0"):
        copy.complete(lambda start, length: memoryview(OBJECT[start:start + length // 2]), 1 << 18, lambda n: None)
    copy.close()
    broken = _copy(tmp_path)
    os.close(broken._fd)  # the descriptor gone, as on a disk that failed: writes raise
    broken.add(0, OBJECT[:100])
    assert isinstance(broken.failed, OSError) and not broken.has(0, 100)
    with pytest.raises(OSError):
        broken.complete(_Store(), 1 << 18, lambda n: None)
