"""Files are opened beneath their dataset's root: a tar (or ``train/``) made a link to
a file elsewhere is refused at start and never read while served, with
``openat2(RESOLVE_BENEATH)`` and without it; links into a directory the operator names
(``--allow-shard-links``) are served."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from core.errors import DataError
from shards import beneath
from shards.beneath import LinkOutside, open_beneath
from shards.reader import ShardDataset


@pytest.fixture(params=["openat2", "realpath"])
def resolution(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Both ways of resolving beneath the root: the kernel's, and the check without it."""
    if request.param == "realpath":
        monkeypatch.setattr(beneath, "_have_openat2", False)
    return str(request.param)


def _copy(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


def _link_out(copy: Path, tmp_path: Path, split: str = "train") -> tuple[Path, Path]:
    """A tar of ``split`` moved outside the root and linked back in: (the link, the file)."""
    tar = sorted((copy / split).glob("*.tar"))[0]
    outside = tmp_path / "elsewhere" / tar.name
    outside.parent.mkdir()
    shutil.move(tar, outside)
    os.symlink(outside, tar)
    return tar, outside


def test_a_link_that_stays_inside_the_root_is_followed_and_one_that_leaves_is_refused(tmp_path, resolution):
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "a").write_bytes(b"inside")
    os.symlink("../a", tmp_path / "root" / "sub" / "b")
    os.symlink("/etc/hostname", tmp_path / "root" / "c")
    for name in ("a", "sub/b"):
        fd = open_beneath(tmp_path / "root", name)
        assert os.read(fd, 6) == b"inside"
        os.close(fd)
    with pytest.raises(LinkOutside, match=r"leads outside the dataset's directory .* \(to /etc/hostname\)"):
        open_beneath(tmp_path / "root", "c")


def test_a_tar_linked_to_a_file_outside_is_refused_at_start_naming_it(shards, tmp_path, resolution):
    # Before: the manifest's paths were checked as strings only, so a link made the daemon
    # read (and serve, with the checksums as a byte oracle) any file it could.
    copy = _copy(shards, tmp_path)
    link, _ = _link_out(copy, tmp_path)
    with pytest.raises(DataError, match=rf"^{link}: leads outside the dataset's directory"):
        ShardDataset.open("s", copy)


def test_a_linked_train_directory_is_refused_too(shards, tmp_path, resolution):
    copy = _copy(shards, tmp_path)
    shutil.move(copy / "train", tmp_path / "train-elsewhere")
    os.symlink(tmp_path / "train-elsewhere", copy / "train")
    with pytest.raises(DataError, match="leads outside the dataset's directory"):
        ShardDataset.open("s", copy)


def test_links_into_an_allowed_directory_are_served(shards, tmp_path, resolution):
    copy = _copy(shards, tmp_path)
    _, outside = _link_out(copy, tmp_path)
    split = ShardDataset.open("s", copy, allowed_links=(outside.parent,)).splits["train"]
    here = ShardDataset.open("s", shards).splits["train"]
    rows = np.arange(len(split))
    assert all(np.array_equal(a, b) for a, b in zip(split.read_many(rows), here.read_many(rows)))


def test_a_tar_swapped_for_a_link_while_served_is_never_read(shards, tmp_path, resolution):
    copy = _copy(shards, tmp_path)
    split = ShardDataset.open("s", copy, recheck_s=0).splits["train"]
    unopened = ShardDataset.open("t", copy, recheck_s=0).splits["train"]  # checked at start, no tar open yet
    rows = np.array([i for i in range(len(split)) if split.shard_of(i) == split.shard_of(0)])
    before = split.read_many(rows)
    link, _ = _link_out(copy, tmp_path)  # its path now names a link to the same bytes, outside
    assert all(np.array_equal(a, b) for a, b in zip(split.read_many(rows), before)), "the file opened is kept"
    with pytest.raises(DataError, match=rf"{link}: cannot open shard: leads outside"):
        unopened.read_many(rows)


@pytest.mark.slow
def test_feeder_serve_refuses_a_linked_tar_with_one_line_and_serves_it_when_allowed(shards, tmp_path):
    copy = _copy(shards, tmp_path)
    link, outside = _link_out(copy, tmp_path)
    command = [sys.executable, "-m", "feeder", "serve", "--port", "0", "--threads", "1", "--dataset", f"x={copy}"]
    refused = subprocess.run(command, capture_output=True, text=True, timeout=120)
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1, refused.stderr
    assert refused.stderr.startswith(f"feeder: bad data: {link}: leads outside"), refused.stderr
    allowed = subprocess.Popen([*command, "--allow-shard-links", str(outside.parent)], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    try:
        assert any(line.startswith("feeder: serving on ") for line in _lines(allowed))
    finally:
        allowed.terminate()
        allowed.wait(30)


def _lines(process: subprocess.Popen[str]):
    for line in process.stdout:  # type: ignore[union-attr]
        yield line
        if line.startswith("feeder: serving on "):
            return
