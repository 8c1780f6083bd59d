"""Reading a tar opened for serving, and noticing it changed under its name."""

from __future__ import annotations

import os

import numpy as np
import pytest

from core.errors import DataError
from shards.tars import OpenTar, TarFiles


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


def _tars(tmp_path, recheck_s: float, data: bytes = b"a" * 4096):
    (tmp_path / "t").mkdir(exist_ok=True)
    (tmp_path / "t" / "shard-000000.tar").write_bytes(data)
    files = TarFiles(tmp_path, ["t/shard-000000.tar"], recheck_s)
    changed: list[str] = []
    files.on_changed(changed.append)
    return files, tmp_path / "t" / "shard-000000.tar", changed


def _read(opened: OpenTar, size: int = 4096) -> bytes:
    buffer = np.empty(size, np.uint8)
    opened.read_into(buffer, 0)
    return buffer.tobytes()


def _later_mtime(path) -> None:
    """A modification time one second on (writes within one clock tick can keep it)."""
    stat = os.stat(path)
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))


def test_a_tar_left_alone_stays_open_as_it_is(tmp_path):
    files, _, changed = _tars(tmp_path, recheck_s=0)
    first = files.get(0)
    assert files.get(0) is first and files.recheck(0) is first
    assert files.generation(0) == 0 and changed == []


def test_a_tar_replaced_by_another_file_of_the_same_size_is_reopened_and_reported(tmp_path):
    files, path, changed = _tars(tmp_path, recheck_s=0)
    first = files.get(0)
    (tmp_path / "new").write_bytes(b"b" * 4096)
    os.replace(tmp_path / "new", path)
    current = files.get(0)
    assert current is not first and _read(current) == b"b" * 4096
    assert files.generation(0) == 1 and changed == ["t/shard-000000.tar"]
    assert _read(first) == b"a" * 4096, "the file replaced stays readable for reads under way"


def test_a_tar_rewritten_in_place_is_reopened_and_reported(tmp_path):
    files, path, changed = _tars(tmp_path, recheck_s=0)
    first = files.get(0)
    with open(path, "r+b") as f:  # same inode, same size
        f.write(b"c" * 100)
    _later_mtime(path)
    assert files.get(0) is not first and files.generation(0) == 1 and changed == ["t/shard-000000.tar"]
    assert files.get(0) is files.get(0), "once per change"


def test_a_tar_is_looked_at_again_only_after_recheck_s_or_when_asked(tmp_path):
    files, path, changed = _tars(tmp_path, recheck_s=3600)
    first = files.get(0)
    _later_mtime(path)
    assert files.get(0) is first and files.generation(0) == 0
    assert files.recheck(0) is not first and files.generation(0) == 1 and len(changed) == 1


def test_a_tar_gone_from_its_path_keeps_the_file_open(tmp_path):
    files, path, changed = _tars(tmp_path, recheck_s=0)
    first = files.get(0)
    path.unlink()
    assert files.get(0) is first and _read(first) == b"a" * 4096 and changed == []


def test_a_tar_that_cannot_be_opened_is_a_data_error_naming_it(tmp_path):
    files = TarFiles(tmp_path, ["t/absent.tar"])
    with pytest.raises(DataError, match=rf"{tmp_path / 't' / 'absent.tar'}: cannot open shard"):
        files.get(0)
    with pytest.raises(ValueError, match="recheck_s"):
        TarFiles(tmp_path, [], recheck_s=-1)
