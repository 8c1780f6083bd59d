"""Reading a tar opened for serving."""

from __future__ import annotations

import os

import numpy as np

from shards.tars import OpenTar


def test_reads_tell_the_page_cache_from_the_disk(tmp_path):
    # A file just written is in the page cache: every read is served from it.
    data = np.arange(1 << 16, dtype=np.uint8).tobytes()
    path = tmp_path / "f"
    path.write_bytes(data)
    opened = OpenTar(path)
    buffer = np.empty(4096, np.uint8)
    done, cached = opened.read_into(buffer, 1000)
    assert done == 4096 and buffer.tobytes() == data[1000:5096]
    assert cached == hasattr(os, "RWF_NOWAIT")
    # At the end of the file: a short read, still from the cache.
    done, cached = opened.read_into(buffer, len(data) - 100)
    assert done == 100 and buffer[:100].tobytes() == data[-100:]
