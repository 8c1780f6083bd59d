"""The sharder's CLI commands: happy path and the one-line errors a user can cause."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from cli.app import app
from sharder.config import SampleDataConfig, ShardConfig, VerifyConfig
from tests.common.options import assert_options_follow
from tests.common.shards import build_sample_tree
from tests.sharder.odd_files import rgb_jpeg, write_tree


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_tree(tmp_path_factory.mktemp("cli"), classes=2, train_per_class=3, val_per_class=1)


def _run(*args: str):
    return CliRunner().invoke(app, [str(a) for a in args])


def _one_line_error(result, *fragments: str) -> None:
    assert result.exit_code != 0
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("feeder: "), result.output
    for fragment in fragments:
        assert fragment in lines[0]


def test_sample_data_shard_verify(tmp_path: Path) -> None:
    made = _run("sample-data", tmp_path / "data", "--classes", "2", "--train-per-class", "2", "--val-per-class", "1",
                "--no-progress")
    assert made.exit_code == 0 and "wrote 6 images" in made.output
    sharded = _run("shard", tmp_path / "data", tmp_path / "out", "--formats", "wds,lmdb", "--no-progress")
    assert sharded.exit_code == 0, sharded.output
    assert sharded.output.strip().splitlines()[-1].startswith("sharded 6 images (train 4, val 2)")
    checked = _run("verify", tmp_path / "out", "--full", "--no-progress")
    assert checked.exit_code == 0 and checked.output.strip().endswith("6 images decoded: OK")


def test_verify_reports_a_damaged_shard(src: Path, tmp_path: Path) -> None:
    assert _run("shard", src, tmp_path / "out", "--no-progress").exit_code == 0
    tar = next((tmp_path / "out" / "train").glob("*.tar"))
    data = bytearray(tar.read_bytes())
    data[700] ^= 0xFF
    tar.write_bytes(bytes(data))
    result = _run("verify", tmp_path / "out", "--no-progress")
    assert result.exit_code == 1 and f"problem: {tar}: sha256 differs" in result.output


def test_missing_src(tmp_path: Path) -> None:
    _one_line_error(_run("shard", tmp_path / "nowhere", tmp_path / "out"), "nowhere", "does not exist")


def test_src_without_images(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", {"cat": {"notes.txt": b"text"}})
    _one_line_error(_run("shard", tmp_path / "src", tmp_path / "out"), "no image files")


def test_out_not_empty(src: Path, tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "old").write_text("x")
    _one_line_error(_run("shard", src, tmp_path / "out"), "not empty", "--overwrite")


def test_unknown_class_in_val_ground_truth(tmp_path: Path) -> None:
    write_tree(tmp_path / "src",
               {"train/n01": {"a.JPEG": rgb_jpeg()}, "val": {"ILSVRC2012_val_00000001.JPEG": rgb_jpeg()}})
    (tmp_path / "src" / "LOC_val_solution.csv").write_text(
        "ImageId,PredictionString\nILSVRC2012_val_00000001,n07 1 2 3 4\n"
    )
    _one_line_error(_run("shard", tmp_path / "src", tmp_path / "out"), "LOC_val_solution.csv", "n07")


def test_unwritable_out(src: Path, tmp_path: Path) -> None:
    blocker = tmp_path / "a_file"
    blocker.write_text("x")  # a path below a file cannot be created, even by root
    _one_line_error(_run("shard", src, blocker / "out"), "cannot write to OUT")


def test_on_error_fail_names_the_bad_file(tmp_path: Path) -> None:
    write_tree(tmp_path / "src", {"cat": {"a.jpg": rgb_jpeg(), "broken.jpg": rgb_jpeg()[:100]}})
    result = _run("shard", tmp_path / "src", tmp_path / "out", "--on-error", "fail", "--no-progress")
    _one_line_error(result, "bad data", "broken.jpg", "truncated")


def test_out_overlapping_src_is_refused(src: Path) -> None:
    _one_line_error(_run("shard", src, src, "--overwrite"), "overlap")
    _one_line_error(_run("shard", src / "train", src, "--overwrite"), "overlap")
    assert (src / "LOC_val_solution.csv").is_file()


def test_bad_option_values(src: Path, tmp_path: Path) -> None:
    _one_line_error(_run("shard", src, tmp_path / "out", "--formats", "zip"), "--formats")
    _one_line_error(_run("shard", src, tmp_path / "out", "--on-error", "ignore"), "--on-error")


def test_verify_without_manifest(tmp_path: Path) -> None:
    _one_line_error(_run("verify", tmp_path), "manifest.json does not exist")


@pytest.mark.parametrize("command,cls", [
    ("shard", ShardConfig), ("verify", VerifyConfig), ("sample-data", SampleDataConfig),
])
def test_options_are_the_config_fields(command: str, cls: type) -> None:
    assert_options_follow(command, cls)


def _manifest_options(out: Path) -> dict:
    return json.loads((out / "manifest.json").read_text())["options"]


def test_sizes_are_given_as_sizes(src: Path, tmp_path: Path) -> None:
    assert _run("shard", src, tmp_path / "out", "--shard-size-bytes", "64K", "--no-progress").exit_code == 0
    assert _manifest_options(tmp_path / "out")["shard_size_bytes"] == 64 << 10


@pytest.mark.parametrize("args,fragment", [
    (("--shard-size-bytes", "12X"), "--shard-size-bytes '12X': expected a size"),
    (("--shard-size-bytes", "100"), "--shard-size-bytes must be at least 1K"),
    (("--max-side-px", "8"), "--max-side-px must be >= 16 px"),
])
def test_bad_sizes_are_one_line(src: Path, tmp_path: Path, args, fragment: str) -> None:
    _one_line_error(_run("shard", src, tmp_path / "out", *args), fragment)


def test_ray_without_ray_installed_is_one_line_naming_the_extra(
        src: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as where it is not installed
    _one_line_error(_run("shard", src, tmp_path / "out", "--ray", "auto"), "--ray needs Ray", "feeder[ray]")
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_ray_tasks_per_node_goes_with_ray(src: Path, tmp_path: Path) -> None:
    _one_line_error(_run("shard", src, tmp_path / "out", "--ray-tasks-per-node", "2"), "--ray-tasks-per-node")


@pytest.mark.cluster  # where `make test-cluster` installed Ray
def test_ray_at_an_address_nothing_answers_is_one_line_naming_it(src: Path, tmp_path: Path) -> None:
    pytest.importorskip("ray")
    _one_line_error(_run("shard", src, tmp_path / "out", "--ray", "127.0.0.1:1"), "--ray 127.0.0.1:1",
                    "no Ray cluster answers")


@pytest.mark.slow
def test_workers_past_the_cpus_are_one_warning_and_the_run_goes_on(src: Path, tmp_path: Path) -> None:
    import subprocess

    from core.cpus import usable_cpus
    from tests.common.env import ROOT, child_env

    result = subprocess.run([sys.executable, "-m", "feeder", "shard", str(src), str(tmp_path / "out"), "--workers",
                             "1000", "--no-progress"], cwd=ROOT, env=child_env(), capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    cpus = usable_cpus()
    line = f"--workers 1000: more than the {cpus} CPUs this process may use; using {cpus}"
    assert result.stderr.splitlines() == [line]
    assert result.stdout.startswith("sharded 8 images")
