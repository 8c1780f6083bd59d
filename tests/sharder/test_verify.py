"""sharder.verify: a good shard directory passes; each kind of damage is reported."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from cli.app import app
from sharder import ShardConfig, shard
from sharder.verify import verify
from shards.writers import file_sha256
from tests.common.shards import build_sample_shards
from tests.sharder.odd_files import huge_jpeg, rgb_jpeg, write_tree


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(
        tmp_path_factory.mktemp("verify"), classes=3, train_per_class=6, val_per_class=2, formats=("wds", "lmdb")
    )


def test_pristine_shards_pass_and_full_decodes_everything(pristine: Path) -> None:
    result = verify(pristine, full=True)
    assert result.problems == [] and result.samples == result.decoded == 24
    assert verify(pristine).decoded == 24  # fewer than the per-split sample size: all of them


def _shift_offsets(root: Path) -> None:
    """An index written wrong (as the manifest records it), not damaged later."""
    path = root / "train" / "index.parquet"
    table = pq.read_table(path)
    offsets = pa.array([o + 512 for o in table.column("offset").to_pylist()], pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("offset"), "offset", offsets), path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"]["index_sha256"] = file_sha256(path)
    (root / "manifest.json").write_text(json.dumps(manifest))


def _miscount(root: Path) -> None:
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["val"]["per_class"]["n00000001"] += 1
    (root / "manifest.json").write_text(json.dumps(manifest))


def _truncate_idx(root: Path) -> None:
    idx = next((root / "train").glob("*.idx"))
    idx.write_text("\n".join(idx.read_text().splitlines()[:-1]) + "\n")


def _damage_lmdb(root: Path) -> None:
    data = root / "val" / "lmdb" / "data.mdb"
    data.write_bytes(data.read_bytes()[:-4096])


@pytest.mark.parametrize(
    "damage,fragment",
    [
        (_shift_offsets, "does not locate"),
        (_miscount, "per-class counts"),
        (_truncate_idx, ".idx: missing or does not match"),
        (_damage_lmdb, "data.mdb"),
    ],
)
def test_damage_is_reported(pristine: Path, tmp_path: Path, damage: Callable[[Path], None], fragment: str) -> None:
    root = tmp_path / "copy"
    shutil.copytree(pristine, root)
    damage(root)
    problems = verify(root).problems
    assert problems and any(fragment in p for p in problems), problems


def _member(root: Path, number: int = 5) -> tuple[Path, str, int]:
    """A tar of the train split, the key of one of its samples and that JPEG's data offset."""
    table = pq.read_table(root / "train" / "index.parquet").to_pylist()
    row = [r for r in table if r["shard"] == table[0]["shard"]][number]
    return root / row["shard"], row["key"], row["offset"]


def _flip(path: Path, start: int, count: int = 40) -> None:
    data = bytearray(path.read_bytes())
    for i in range(start, start + count):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _verify_cli(root: Path) -> tuple[int, list[str]]:
    result = CliRunner().invoke(app, ["verify", str(root), "--full", "--no-progress"])
    return result.exit_code, [line for line in result.output.splitlines() if line.startswith("problem:")]


@pytest.mark.parametrize("where", ["jpeg header", "tar header"])
def test_flipped_header_bytes_are_one_problem_naming_shard_and_key(pristine: Path, tmp_path: Path, where: str) -> None:
    root = Path(shutil.copytree(pristine, tmp_path / "copy"))
    tar, key, offset = _member(root)
    _flip(tar, offset + 2 if where == "jpeg header" else offset - 512)
    code, problems = _verify_cli(root)
    assert code == 1 and len(problems) == 1, problems
    assert str(tar) in problems[0] and key in problems[0], problems


def _rewrite_one_label(root: Path) -> None:
    """Damage that still parses: a value changed after the manifest was written."""
    path = root / "train" / "index.parquet"
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    labels[0] = labels[0] + 1
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int64())), path)


def _garble(root: Path) -> None:
    path = root / "train" / "index.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 3 : len(data) // 3 + 200] = bytes(200)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("damage", [_rewrite_one_label, _garble])
def test_a_damaged_index_is_one_problem_and_exit_1(
    pristine: Path, tmp_path: Path, damage: Callable[[Path], None]
) -> None:
    root = Path(shutil.copytree(pristine, tmp_path / "copy"))
    damage(root)
    code, problems = _verify_cli(root)
    assert code == 1 and len(problems) == 1, problems
    assert str(root / "train" / "index.parquet") in problems[0]


@pytest.mark.parametrize(("manifest", "message"), [
    ([], "manifest.json: expected a JSON object, got a list"),
    ({"format_version": 1, "layout": "folders", "source": "src", "classes": [], "splits": []},
     "manifest.json: splits: expected an object of splits, got a list"),
])
def test_a_manifest_of_the_wrong_shape_is_one_line_and_exit_1(
    pristine: Path, tmp_path: Path, manifest, message
) -> None:
    root = Path(shutil.copytree(pristine, tmp_path / "copy"))
    (root / "manifest.json").write_text(json.dumps(manifest))
    result = CliRunner().invoke(app, ["verify", str(root), "--no-progress"])
    assert result.exit_code == 1, result.output
    assert result.output.strip() == f"feeder: bad data: {root}/{message}", result.output


@pytest.mark.slow
def test_a_decompression_bomb_in_a_shard_is_one_problem_naming_its_key(tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", {"a": {"bomb.jpg": huge_jpeg(), "ok.jpg": rgb_jpeg(1)}})
    out = tmp_path / "out"
    shard(ShardConfig(src, out, check="header", max_pixels=500_000_000))  # let the bomb in
    manifest = json.loads((out / "manifest.json").read_text())
    del manifest["options"]["max_pixels"]  # as a shard directory from before the option
    (out / "manifest.json").write_text(json.dumps(manifest))
    rows = pq.read_table(out / "train" / "index.parquet").to_pylist()
    key = next(r["key"] for r in rows if r["source"] == "a/bomb.jpg")
    code, problems = _verify_cli(out)
    assert code == 1 and len(problems) == 1 and key in problems[0] and "20000x20000" in problems[0], problems


def _same_size_elsewhere(root: Path, numbers: tuple[int, ...]) -> list[str]:
    """Samples ``numbers`` of the first train tar overwritten in place by the start
    of another sample's JPEG (a valid header, other pixels; same size): the tar as
    ``dd conv=notrunc`` leaves it. Their keys."""
    table = pq.read_table(root / "train" / "index.parquet").to_pylist()
    rows = [r for r in table if r["shard"] == table[0]["shard"]]
    with open(root / rows[0]["shard"], "r+b") as f:
        for number in numbers:
            donor = max(rows, key=lambda r: r["size"])
            f.seek(donor["offset"])
            data = f.read(rows[number]["size"])
            f.seek(rows[number]["offset"])
            f.write(data)
    return [rows[number]["key"] for number in numbers]


@pytest.mark.parametrize("full", [False, True])
def test_samples_changed_in_place_are_one_problem_each_naming_tar_and_key(
    pristine: Path, tmp_path: Path, full: bool
) -> None:
    root = Path(shutil.copytree(pristine, tmp_path / "copy"))
    keys = _same_size_elsewhere(root, (1, 4))
    problems = verify(root, full=full).problems
    assert len(problems) == 2, problems
    for key, problem in zip(keys, problems):
        assert problem.startswith(f"{root / 'train'}/shard-")
        assert f"sample {key}: image differs from its checksum" in problem


def test_without_checksums_in_the_index_verify_checks_as_before(pristine: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(pristine, tmp_path / "copy"))
    path = root / "train" / "index.parquet"
    pq.write_table(pq.read_table(path).drop_columns(["checksum", "half_checksum"])
                   .replace_schema_metadata({b"feeder.index_version": b"2"}), path)
    manifest = json.loads((root / "manifest.json").read_text())
    manifest["splits"]["train"].update(index_version=2, index_sha256=file_sha256(path))
    (root / "manifest.json").write_text(json.dumps(manifest))
    assert verify(root, full=True).problems == []
    _same_size_elsewhere(root, (1,))
    problems = verify(root, full=True).problems
    assert len(problems) == 1 and "checksum in the index" not in problems[0], problems
