"""A write into OUT that fails ends ``feeder shard`` with one line naming the file and
the reason, exit 1; the same command afterwards resumes and ends byte-identical to an
uninterrupted run.

The failures are real: a file of the run made a link to ``/dev/full`` (every write to
it fails with ENOSPC, as on a full disk), or the run's files limited in size with
``RLIMIT_FSIZE`` (EFBIG, as on a file system with a size limit)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from core.errors import ConfigError
from sharder.out_dir import write_errors_named
from tests.sharder.runs import kill_after_second_shard, shard_command, tree_bytes

_NO_ROOM = "(resume with the same command once there is room)"


def _assert_one_line(process, line: str) -> None:
    assert process.returncode == 1, process.stderr
    assert process.stderr == line + "\n"


@pytest.mark.slow
@pytest.mark.parametrize("planted", ["train/shard-000003.tar", "train/index.parquet", "manifest.json"])
def test_no_space_left_is_one_line_and_the_same_command_resumes(src: Path, reference: Path, tmp_path: Path,
                                                                planted: str) -> None:
    out = tmp_path / "out"
    assert kill_after_second_shard(src, out).returncode == -9
    (out / f"{planted}.tmp").symlink_to("/dev/full")  # where the run writes it first

    failed = shard_command(src, out)

    _assert_one_line(failed, f"feeder: error: {out / planted}: no space left on device {_NO_ROOM}")
    assert not (out / f"{planted}.tmp").is_symlink()  # the run removed its temporary file
    assert not (out / planted).exists() and not (out / "manifest.json").exists()
    kept = os.stat(out / "train" / "shard-000000.tar")

    resumed = shard_command(src, out)

    assert resumed.returncode == 0, resumed.stderr
    assert resumed.stdout.startswith("sharded 42 images (train 36, val 6) into 5 shards")
    again = os.stat(out / "train" / "shard-000000.tar")
    assert (again.st_ino, again.st_mtime_ns) == (kept.st_ino, kept.st_mtime_ns)  # not rewritten
    assert tree_bytes(out) == tree_bytes(reference)


@pytest.mark.slow
def test_a_tar_over_the_file_size_limit_is_one_line_and_resumes(src: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    failed = shard_command(src, out, file_size_bytes=40_000)  # below the first tar's 58,880 bytes

    _assert_one_line(failed, f"feeder: error: {out / 'train' / 'shard-000000.tar'}: file too large {_NO_ROOM}")
    assert sorted(p.name for p in (out / "train").iterdir()) == []

    assert shard_command(src, out).returncode == 0
    assert tree_bytes(out) == tree_bytes(reference)


@pytest.mark.slow
def test_an_lmdb_over_the_file_size_limit_is_one_line_and_resumes(src: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    failed = shard_command(src, out, file_size_bytes=100_000)  # every tar fits, train's LMDB does not

    assert failed.returncode == 1, failed.stderr
    assert failed.stderr.count("\n") == 1, failed.stderr
    assert failed.stderr.startswith(f"feeder: error: {out / 'train' / 'lmdb'}: "), failed.stderr
    assert sorted(p.name for p in (out / "train").glob("*.tar")) == [f"shard-00000{i}.tar" for i in range(4)]
    assert not (out / "train" / "lmdb").exists() and not (out / "train" / "lmdb.tmp").exists()
    kept = os.stat(out / "train" / "shard-000003.tar")

    assert shard_command(src, out).returncode == 0
    assert os.stat(out / "train" / "shard-000003.tar").st_ino == kept.st_ino
    assert tree_bytes(out) == tree_bytes(reference)


@pytest.mark.parametrize(("code", "hint"), [
    (errno.ENOSPC, _NO_ROOM),
    (errno.EDQUOT, _NO_ROOM),
    (errno.EFBIG, _NO_ROOM),
    (errno.EROFS, "(resume with the same command once OUT is writable)"),
    (errno.EACCES, "(resume with the same command once OUT is writable)"),
    (errno.EIO, "(run the same command again to resume)"),
])
def test_each_reason_has_its_way_on(tmp_path: Path, code: int, hint: str) -> None:
    target = tmp_path / "out" / "train" / "shard-000001.tar"
    with pytest.raises(ConfigError) as refused, write_errors_named(tmp_path / "out"):
        raise OSError(code, "as the system says it", str(target))
    reason = os.strerror(code)
    assert str(refused.value) == f"{target}: {reason[:1].lower()}{reason[1:]} {hint}"


def test_an_error_outside_out_is_not_called_a_write_into_out(tmp_path: Path) -> None:
    with pytest.raises(PermissionError), write_errors_named(tmp_path / "out"):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "src" / "a.jpg"))
    with pytest.raises(PermissionError), write_errors_named(tmp_path / "out"):
        raise PermissionError(errno.EACCES, "Permission denied", str(tmp_path / "out-of-it"))


def test_no_room_naming_no_file_names_out(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=f"^OUT {tmp_path}: no space left on device"), write_errors_named(tmp_path):
        raise OSError(errno.ENOSPC, "No space left on device")
