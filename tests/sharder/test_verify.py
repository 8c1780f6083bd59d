"""sharder.verify: a good shard directory passes; each kind of damage is reported."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from sharder.verify import verify
from tests.common.shards import build_sample_shards


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("verify"), classes=3, train_per_class=6, val_per_class=2, formats=("wds", "lmdb"))


def test_pristine_shards_pass_and_full_decodes_everything(pristine: Path) -> None:
    result = verify(pristine, full=True)
    assert result.problems == [] and result.samples == result.decoded == 24
    assert verify(pristine).decoded == 24  # fewer than the per-split sample size: all of them


def _shift_offsets(root: Path) -> None:
    path = root / "train" / "index.parquet"
    table = pq.read_table(path)
    offsets = pa.array([o + 512 for o in table.column("offset").to_pylist()], pa.int64())
    pq.write_table(table.set_column(table.schema.get_field_index("offset"), "offset", offsets), path)


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
    [(_shift_offsets, "does not locate"), (_miscount, "per-class counts"), (_truncate_idx, ".idx: missing or does not match"), (_damage_lmdb, "data.mdb")],
)
def test_damage_is_reported(pristine: Path, tmp_path: Path, damage: Callable[[Path], None], fragment: str) -> None:
    root = tmp_path / "copy"
    shutil.copytree(pristine, root)
    damage(root)
    problems = verify(root).problems
    assert problems and any(fragment in p for p in problems), problems
