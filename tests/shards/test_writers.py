"""shards.writers: tar headers, temporary files, abort on error, failed writes named."""

from __future__ import annotations

import errno
import tarfile
from pathlib import Path

import pytest

from shards.layout import INDEX_SCHEMA
from shards.writers import LmdbWriter, Sample, TarShardWriter, ustar_header, write_index, write_json_atomic


@pytest.mark.parametrize(
    "name,size", [("a.jpg", 0), ("00000001_n01440764_10026.jpg", 110_000), ("x" * 99, 8**11 - 1), ("k.cls", 3)]
)
def test_ustar_header_equals_the_standard_library(name: str, size: int) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode, info.uid, info.gid, info.uname, info.gname = size, 0, 0o644, 0, 0, "", ""
    assert ustar_header(name, size) == info.tobuf(tarfile.USTAR_FORMAT, "ascii", "strict")


def test_ustar_header_refuses_what_does_not_fit() -> None:
    with pytest.raises(ValueError):
        ustar_header("x" * 100, 1)
    with pytest.raises(ValueError):
        ustar_header("a.jpg", 8**11)


def test_tar_is_invisible_until_finished_and_removed_on_error(tmp_path: Path) -> None:
    final = tmp_path / "shard-000000.tar"
    with pytest.raises(RuntimeError):
        with TarShardWriter(final) as writer:
            writer.write(Sample("00000000_a", 1, b"\xff\xd8data\xff\xd9", 1, 1))
            assert not final.exists() and writer.temp_path.exists()
            raise RuntimeError("stop")
    assert list(tmp_path.iterdir()) == []
    with TarShardWriter(final) as writer:
        offset, size, *_ = writer.write(Sample("00000000_a", 7, b"\xff\xd8data\xff\xd9", 1, 1))
        writer.finish()
    with tarfile.open(final) as tar:
        assert [(m.name, m.offset_data, m.size, m.mtime, m.uid) for m in tar] == [
            ("00000000_a.jpg", offset, size, 0, 0),
            ("00000000_a.cls", 1536, 1, 0, 0),
        ]
        assert tar.extractfile("00000000_a.cls").read() == b"7"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard-000000.idx", "shard-000000.tar"]


def _full_disk_at(path: Path) -> None:
    """Every write to ``path`` fails with ENOSPC, as on a full disk."""
    path.symlink_to("/dev/full")


def test_a_tar_that_cannot_be_written_names_its_final_path_and_leaves_nothing(tmp_path: Path) -> None:
    final = tmp_path / "shard-000000.tar"
    _full_disk_at(tmp_path / "shard-000000.tar.tmp")
    with pytest.raises(OSError) as failed, TarShardWriter(final) as writer:
        for i in range(40):  # past the write buffer
            writer.write(Sample(f"{i:08d}_a", 1, bytes(1000), 1, 1))
        writer.finish()
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(final))
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("write", [
    lambda path: write_json_atomic(path, {"a": 1}),
    lambda path: write_index(path, {name: [] for name in INDEX_SCHEMA.names}),
], ids=["json", "index"])
def test_a_file_that_cannot_be_written_names_its_path_and_leaves_nothing(tmp_path: Path, write) -> None:
    final = tmp_path / "file"
    _full_disk_at(tmp_path / "file.tmp")
    with pytest.raises(OSError) as failed:
        write(final)
    assert (failed.value.errno, failed.value.filename) == (errno.ENOSPC, str(final))
    assert list(tmp_path.iterdir()) == []


def test_an_lmdb_error_with_a_system_code_is_an_os_error_naming_the_output(tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # nothing can be created below a file
    final = blocker / "lmdb"
    with pytest.raises(OSError) as failed:
        LmdbWriter(final, map_size_bytes=1 << 20)
    assert failed.value.errno == errno.ENOTDIR and failed.value.filename == str(final)
