"""sharder.tar_members: the members of a tar from its headers, the same as
``tarfile`` reads them, in every tar format; damage told with the members before it."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

import pytest

from sharder.source_reads import LocalFiles
from sharder.tar_members import Entry, TarDamaged, TarWindow, tar_entries

LONG = "deep/" * 25 + "n01440764_10026.JPEG"  # over ustar's 100-byte name, under its 255 with the prefix


def _tar(path: Path, tar_format: int) -> Path:
    with tarfile.open(path, "w", format=tar_format) as tar:
        for name, data in (("a.JPEG", b"x" * 700), (LONG, b"y" * 3), ("empty.JPEG", b"")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        folder = tarfile.TarInfo("folder")
        folder.type = tarfile.DIRTYPE
        tar.addfile(folder)
        link = tarfile.TarInfo("link.JPEG")
        link.type, link.linkname = tarfile.SYMTYPE, "a.JPEG"
        tar.addfile(link)
    return path


def _expected(path: Path) -> list[Entry]:
    with tarfile.open(path) as tar:
        return [Entry(m.name, "dir" if m.isdir() else "file" if m.isreg() else "other", m.offset_data,
                      m.size if m.isreg() else 0) for m in tar]


def _window(path: Path, size: int | None = None) -> TarWindow:
    return TarWindow(LocalFiles(path.parent), path.name, 0, path.stat().st_size if size is None else size)


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_members_are_those_tarfile_reads(tmp_path: Path, tar_format: int) -> None:
    path = _tar(tmp_path / "t.tar", tar_format)
    entries = tar_entries(_window(path))
    assert entries == _expected(path) and entries[1].name == LONG
    assert [path.read_bytes()[e.offset:e.offset + e.size] for e in entries[:3]] == [b"x" * 700, b"y" * 3, b""]


@pytest.mark.parametrize("tar_format", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT])
def test_a_tar_cut_inside_a_member_keeps_the_members_before(tmp_path: Path, tar_format: int) -> None:
    path = _tar(tmp_path / "t.tar", tar_format)
    second = _expected(path)[1]
    cut = tmp_path / "cut.tar"
    cut.write_bytes(path.read_bytes()[:second.offset + 1])
    with pytest.raises(TarDamaged, match="truncated: ends inside") as caught:
        tar_entries(_window(cut))
    assert caught.value.entries == _expected(path)[:1]


def test_garbage_is_not_a_tar(tmp_path: Path) -> None:
    path = tmp_path / "t.tar"
    path.write_bytes(b"PK\3\4 a zip file, say" * 100)
    with pytest.raises(TarDamaged, match="^not a tar file"):
        tar_entries(_window(path))


def test_a_gnu_headers_times_are_not_taken_for_a_name_prefix(tmp_path: Path) -> None:
    path = tmp_path / "gnu.tar"
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("n01440764_10026.JPEG")
        info.size = 5
        tar.addfile(info, io.BytesIO(b"jpeg!"))
    raw = bytearray(path.read_bytes())
    raw[345:357] = b"14177242531\0"  # atime, where ustar keeps its name prefix (GNU tar --incremental)
    raw[148:156] = b" " * 8
    raw[148:155] = b"%06o\0" % sum(raw[:512])
    path.write_bytes(bytes(raw))
    # As GNU tar reads it (Python's tarfile takes the times for a prefix).
    assert tar_entries(_window(path)) == [Entry("n01440764_10026.JPEG", "file", 512, 5)]
