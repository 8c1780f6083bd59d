"""shards.writers: tar headers, temporary files, abort on error."""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest

from shards.writers import Sample, TarShardWriter, ustar_header


@pytest.mark.parametrize("name,size", [("a.jpg", 0), ("00000001_n01440764_10026.jpg", 110_000), ("x" * 99, 8**11 - 1), ("k.cls", 3)])
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
