"""A manifest of the wrong shape, or one whose classes are fewer than the index's
labels need, is refused at open with one line naming the file and the field: through
``ShardDataset.open`` and through ``feeder serve``."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.errors import DataError
from shards.layout import index_path
from shards.manifest import read_manifest
from shards.reader import ShardDataset
from tests.common.shards import seal_index

ROOT = Path(__file__).resolve().parents[2]


def _copy(shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(shards, tmp_path / "copy"))


def _edit_manifest(root: Path, edit: Callable[[dict[str, Any]], Any]) -> None:
    """Rewrite ``root``'s manifest as what ``edit`` returns for it."""
    path = root / "manifest.json"
    path.write_text(json.dumps(edit(json.loads(path.read_text()))))


def _set(*keys: Any, value: Any) -> Callable[[dict[str, Any]], Any]:
    def edit(manifest: dict[str, Any]) -> Any:
        target = manifest
        for key in keys[:-1]:
            target = target[key]
        target[keys[-1]] = value
        return manifest
    return edit


def _drop(key: str) -> Callable[[dict[str, Any]], Any]:
    return lambda manifest: {k: v for k, v in manifest.items() if k != key}


def _one_class_fewer(manifest: dict[str, Any]) -> Any:
    return manifest | {"classes": manifest["classes"][:-1]}


def _one_class_more(manifest: dict[str, Any]) -> Any:
    return manifest | {"classes": [*manifest["classes"], "n99999999"]}


# (what is wrong, the edit, what the line says after the manifest's path)
_BAD_MANIFESTS = [
    ("a list", lambda m: [m], "expected a JSON object, got a list"),
    ("a string", lambda m: "manifest", "expected a JSON object, got a string"),
    ("a number", lambda m: 3, "expected a JSON object, got a number"),
    ("null", lambda m: None, "expected a JSON object, got null"),
    ("classes a string", _set("classes", value="n01"), "classes: expected a list of class names, got a string"),
    ("a class a number", _set("classes", 1, value=7),
     r"classes\[1\]: expected a class name \(a string\), got a number"),
    ("no classes", _drop("classes"), "classes: missing, expected a list of class names"),
    ("splits a list", _set("splits", value=[]), "splits: expected an object of splits, got a list"),
    ("no splits", _set("splits", value={}), "splits: lists no splits"),
    ("a split a string", _set("splits", "val", value="val"), r"splits\.val: expected an object, got a string"),
    ("a count a string", _set("splits", "val", "num_samples", value="16"),
     r"splits\.val\.num_samples: expected an integer, got a string"),
    ("a count a boolean", _set("splits", "val", "num_samples", value=True),
     r"splits\.val\.num_samples: expected an integer, got true"),
    ("a count below 0", _set("splits", "val", "num_samples", value=-1),
     r"splits\.val\.num_samples: expected a count \(0 or more\), got -1"),
    ("a version a float", _set("splits", "val", "index_version", value=3.0),
     r"splits\.val\.index_version: expected an integer, got a number"),
    ("shards an object", _set("splits", "train", "shards", value={}),
     r"splits\.train\.shards: expected a list of shards, got an object"),
    ("a shard a string", _set("splits", "train", "shards", 0, value="train/shard-000000.tar"),
     r"splits\.train\.shards\[0\]: expected an object, got a string"),
    ("a shard path a number", _set("splits", "train", "shards", 0, "path", value=0),
     r"splits\.train\.shards\[0\]\.path: expected a path \(a string\), got a number"),
    ("a shard path out of the directory", _set("splits", "train", "shards", 0, "path", value="../../etc/passwd"),
     r"splits\.train\.shards\[0\]\.path: '\.\./\.\./etc/passwd' is not a relative path inside the shard directory"),
    ("a shard path absolute", _set("splits", "train", "shards", 0, "path", value="/etc/passwd"),
     r"splits\.train\.shards\[0\]\.path: '/etc/passwd' is not a relative path inside the shard directory"),
    ("a shard size a string", _set("splits", "train", "shards", 0, "bytes", value="1000"),
     r"splits\.train\.shards\[0\]\.bytes: expected an integer, got a string"),
]


@pytest.mark.parametrize(("what", "edit", "message"), _BAD_MANIFESTS, ids=[case[0] for case in _BAD_MANIFESTS])
def test_a_manifest_of_the_wrong_shape_is_refused_naming_the_field(shards, tmp_path, what, edit, message) -> None:
    copy = _copy(shards, tmp_path)
    _edit_manifest(copy, edit)
    with pytest.raises(DataError, match=f"^{re.escape(str(copy / 'manifest.json'))}: {message}$"):
        ShardDataset.open("x", copy)


def test_read_manifest_refuses_json_that_is_not_an_object(shards, tmp_path) -> None:
    copy = _copy(shards, tmp_path)
    (copy / "manifest.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="manifest.json: expected a JSON object, got a list$"):
        read_manifest(copy)


def test_fewer_classes_than_the_labels_need_are_refused(shards, tmp_path) -> None:
    copy = _copy(shards, tmp_path)
    _edit_manifest(copy, _one_class_fewer)
    classes = len(json.loads((copy / "manifest.json").read_text())["classes"])
    message = f"labels up to {classes}, but the manifest lists {classes} classes$"
    with pytest.raises(DataError, match=f"^{re.escape(str(index_path(copy, 'train')))}: {message}"):
        ShardDataset.open("x", copy)


def test_a_negative_label_is_refused_naming_its_key(shards, tmp_path) -> None:
    copy = _copy(shards, tmp_path)
    path = index_path(copy, "val")
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    labels[2] = -1
    table = table.set_column(table.schema.get_field_index("label"), "label", pa.array(labels, pa.int64()))
    pq.write_table(table, path)
    seal_index(copy, "val")
    key = table.column("key")[2].as_py()
    with pytest.raises(DataError, match=f"{re.escape(str(path))}: key '{key}' has label -1$"):
        ShardDataset.open("x", copy)


def test_every_class_is_accepted_where_the_last_has_no_samples(shards, tmp_path) -> None:
    copy = _copy(shards, tmp_path)
    _edit_manifest(copy, _one_class_more)
    assert ShardDataset.open("x", copy).classes[-1] == "n99999999"


def _serve(root: Path) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "feeder", "serve", "--port", "0", "--threads", "1", "--dataset", f"x={root}"]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.mark.slow
@pytest.mark.parametrize(("edit", "message"), [
    (lambda m: [m], "manifest.json: expected a JSON object, got a list"),
    (lambda m: "manifest", "manifest.json: expected a JSON object, got a string"),
    (_set("splits", "val", "num_samples", value="16"), "splits.val.num_samples: expected an integer, got a string"),
    (_one_class_fewer, "index.parquet: labels up to 3, but the manifest lists 3 classes"),
], ids=["a list", "a string", "a count a string", "one class fewer"])
def test_feeder_serve_refuses_a_bad_manifest_with_one_line(shards, tmp_path, edit, message) -> None:
    copy = _copy(shards, tmp_path)
    _edit_manifest(copy, edit)
    process = _serve(copy)
    assert process.returncode == 1, process.stderr
    assert process.stderr.count("\n") == 1, process.stderr
    assert process.stderr.startswith(f"feeder: bad data: {copy}"), process.stderr
    assert process.stderr.rstrip().endswith(message), process.stderr
