"""Byte-identical output for the same SRC and seed, with any number of workers, and
after a run killed with SIGKILL part-way is started again."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sharder import ShardConfig, shard

REPO = Path(__file__).resolve().parents[2]
SHARD_BYTES = 60_000


def _tree_bytes(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_same_seed_gives_identical_bytes_with_two_workers(src: Path, reference: Path, tmp_path: Path) -> None:
    out = tmp_path / "again"
    shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=7, shard_size_bytes=SHARD_BYTES, workers=2))
    assert _tree_bytes(out) == _tree_bytes(reference)
    assert len(list(reference.glob("train/*.tar"))) >= 3


_KILL_AFTER_SECOND_SHARD = """
import os, signal, sys
from sharder import ShardConfig, shard

def die(split, number):
    if number == 1:
        os.kill(os.getpid(), signal.SIGKILL)

shard(ShardConfig(sys.argv[1], sys.argv[2], formats=("wds", "lmdb"), seed=7,
                  shard_size_bytes=int(sys.argv[3]), on_shard_done=die))
"""


def test_killed_run_resumes_without_redoing_shards_and_ends_identical(
    src: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    command = [sys.executable, "-c", _KILL_AFTER_SECOND_SHARD, str(src), str(out), str(SHARD_BYTES)]
    process = subprocess.run(command, cwd=REPO, capture_output=True, timeout=120)
    assert process.returncode == -9, process.stderr.decode()
    assert not (out / "manifest.json").exists()
    finished = sorted(p.name for p in (out / "train").glob("*.tar"))
    assert finished == ["shard-000000.tar", "shard-000001.tar"]
    for name in finished:  # whatever is under a final name is complete
        assert (out / "train" / name).read_bytes() == (reference / "train" / name).read_bytes()
    first = os.stat(out / "train" / "shard-000000.tar")

    shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=7, shard_size_bytes=SHARD_BYTES))

    again = os.stat(out / "train" / "shard-000000.tar")
    assert (again.st_ino, again.st_mtime_ns) == (first.st_ino, first.st_mtime_ns)  # not rewritten
    assert _tree_bytes(out) == _tree_bytes(reference)


def test_a_run_killed_before_checksums_were_recorded_resumes_with_them(
    src: Path, reference: Path, tmp_path: Path
) -> None:
    out = tmp_path / "killed"
    command = [sys.executable, "-c", _KILL_AFTER_SECOND_SHARD, str(src), str(out), str(SHARD_BYTES)]
    assert subprocess.run(command, cwd=REPO, capture_output=True, timeout=120).returncode == -9
    for record in (out / ".work" / "train").glob("shard-*.json"):  # as an earlier version recorded them
        fields = json.loads(record.read_text())
        fields["rows"] = [row[:9] for row in fields["rows"]]
        record.write_text(json.dumps(fields))

    shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=7, shard_size_bytes=SHARD_BYTES))

    assert _tree_bytes(out) == _tree_bytes(reference)


def test_unfinished_run_with_other_options_is_not_resumed(src: Path, tmp_path: Path) -> None:
    from core.errors import ConfigError

    src = Path(shutil.copytree(src, tmp_path / src.name))  # a file is added to it: the shared tree is only read
    out = tmp_path / "out"
    command = [sys.executable, "-c", _KILL_AFTER_SECOND_SHARD, str(src), str(out), str(SHARD_BYTES)]
    subprocess.run(command, cwd=REPO, capture_output=True, timeout=120)
    with pytest.raises(ConfigError, match="unfinished run of other inputs or options"):
        shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=8, shard_size_bytes=SHARD_BYTES))
    extra = src / "train" / "n00000001" / "added.JPEG"
    extra.write_bytes((src / "train" / "n00000001" / "n00000001_1.JPEG").read_bytes())
    try:
        with pytest.raises(ConfigError, match="unfinished run of other inputs"):
            shard(ShardConfig(src, out, formats=("wds", "lmdb"), seed=7, shard_size_bytes=SHARD_BYTES))
    finally:
        extra.unlink()
