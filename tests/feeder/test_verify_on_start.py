"""``feeder serve --verify-on-start``: a dataset whose files differ from their manifest
is refused before anything is served, with one line naming the file; without the
option a start reads only manifests and indexes."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from core.errors import DataError
from tests.feeder.conftest import start


def _damaged_copy(shards: Path, tmp_path: Path) -> tuple[Path, Path]:
    """A copy of ``shards`` with one tar's bytes changed in place, size kept."""
    copy = Path(shutil.copytree(shards, tmp_path / "damaged"))
    tar = sorted(copy.glob("train/*.tar"))[0]
    data = bytearray(tar.read_bytes())
    data[len(data) // 2] ^= 0xFF
    tar.write_bytes(bytes(data))
    return copy, tar


def test_a_verified_start_serves_intact_shards(shards: Path):
    server, _ = start({"sample": shards}, verify_on_start=True)
    try:
        assert set(server.service.datasets) == {"sample"}
    finally:
        server.stop(0).wait(10)


def test_a_tar_changed_in_place_stops_a_verified_start_naming_it(shards: Path, tmp_path: Path):
    copy, tar = _damaged_copy(shards, tmp_path)
    with pytest.raises(DataError) as caught:
        start({"intact": shards, "damaged": copy}, verify_on_start=True)
    message = str(caught.value)
    assert message.startswith("verify_on_start: dataset damaged: ") and str(tar) in message
    assert "sha256" in message
    server, _ = start({"damaged": copy})  # the default start reads no tar
    server.stop(0).wait(10)


def test_serve_with_verify_on_start_exits_with_one_line(shards: Path, tmp_path: Path):
    copy, tar = _damaged_copy(shards, tmp_path)
    result = CliRunner().invoke(app, ["serve", "--dataset", f"sample={copy}", "--port", "0", "--device", "cpu",
                                      "--verify-on-start"])
    assert result.exit_code == 1
    line = result.output.strip()
    assert "\n" not in line and line.startswith("feeder: bad data: verify_on_start: dataset sample: ")
    assert str(tar) in line
