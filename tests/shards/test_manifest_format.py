"""The manifest's records, its documented shape and its format version cannot drift:
the keys of each record are pinned here per format version (``KEYS``), and must be
the dataclass fields of :mod:`shards.manifest` and the shape in :mod:`shards.layout`;
a published version's keys never change, so a new key is a new version. The one
parser and the one writer round-trip, old manifests (without the keys added later)
still read, and a field of the wrong type is refused naming its path."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest

import shards.layout
from core.errors import DataError
from shards.json_records import JsonRecord
from shards.layout import MANIFEST_NAME
from shards.manifest import (
    FORMAT_VERSION,
    FORMAT_VERSIONS,
    LmdbEntry,
    Manifest,
    ShardEntry,
    SkippedInput,
    SplitEntry,
    read_manifest,
)
from shards.writers import write_manifest
from tests.common.shards import build_sample_shards

_RECORDS: dict[str, type[JsonRecord]] = {
    "Manifest": Manifest, "SplitEntry": SplitEntry, "ShardEntry": ShardEntry, "LmdbEntry": LmdbEntry,
    "SkippedInput": SkippedInput,
}

# Per format version, each record's keys in the order written; "?" marks an optional
# key (absent from manifests written before it was added). Add a row for a new
# version, never edit a published one (its digest is pinned in _PUBLISHED).
KEYS: dict[int, dict[str, tuple[str, ...]]] = {
    1: {
        "Manifest": ("format_version", "layout", "source", "classes", "splits", "options"),
        "SplitEntry": ("num_samples", "accepted", "rejected", "reencoded?", "ignored", "inputs", "per_class", "index",
                       "index_version?", "shards", "rejects", "skipped_links?", "empty_classes?", "index_sha256?",
                       "lmdb?"),
        "ShardEntry": ("path", "index", "samples", "bytes", "sha256"),
        "LmdbEntry": ("path", "samples", "bytes", "sha256"),
        "SkippedInput": ("source", "reason"),
    },
}
_PUBLISHED = {1: "6667e6bd66bdfbec"}  # first 16 hex digits of _digest(KEYS[v])

# A manifest as the first sharder wrote it: none of the keys added later.
_FIRST = {
    "format_version": 1, "layout": "folders", "source": "/data/fruit", "classes": ["apple", "zebra"],
    "splits": {"train": {
        "num_samples": 2, "accepted": 2, "rejected": 1, "ignored": 0, "inputs": 3,
        "per_class": {"apple": 1, "zebra": 1}, "index": "train/index.parquet",
        "shards": [{"path": "train/shard-000000.tar", "index": "train/shard-000000.idx", "samples": 2,
                    "bytes": 10240, "sha256": "a" * 64}],
        "rejects": [{"source": "apple/bad.jpg", "reason": "not an image"}],
    }},
    "options": {"formats": ["wds"], "seed": 0},
}


def _digest(keys: dict[str, tuple[str, ...]]) -> str:
    return hashlib.sha256(json.dumps(keys, sort_keys=True).encode()).hexdigest()[:16]


def _fields(record: type[JsonRecord]) -> tuple[str, ...]:
    fields = (f for f in dataclasses.fields(record) if f.name != "extra")  # type: ignore[arg-type]
    return tuple(f.name + ("?" if f.default is None else "") for f in fields)


def _documented() -> dict[str, tuple[str, ...]]:
    """The shape in ``shards.layout``'s docstring: record name lines, then one key per
    indented line."""
    doc = shards.layout.__doc__ or ""
    block = doc[doc.index(f"Shape (``FORMAT_VERSION`` {FORMAT_VERSION})"):].split("::\n\n", 1)[1].split("\n\n")[0]
    shape: dict[str, list[str]] = {}
    for line in block.splitlines():
        if match := re.fullmatch(r" {4}(\w+)", line):
            shape[match[1]] = []
        else:
            shape[list(shape)[-1]].append(line.split()[0])
    return {name: tuple(keys) for name, keys in shape.items()}


def test_the_records_the_table_and_the_documented_shape_have_the_same_keys() -> None:
    assert {name: _fields(record) for name, record in _RECORDS.items()} == KEYS[FORMAT_VERSION]
    assert _documented() == KEYS[FORMAT_VERSION]


def test_a_new_key_is_a_new_format_version() -> None:
    assert FORMAT_VERSION == max(KEYS) and FORMAT_VERSIONS == tuple(sorted(KEYS))
    assert {v: _digest(KEYS[v]) for v in KEYS if v in _PUBLISHED} == _PUBLISHED, "a published version changed"
    for older, newer in zip(sorted(KEYS), sorted(KEYS)[1:]):
        for name, keys in KEYS[older].items():
            assert {k.rstrip("?") for k in keys} <= {k.rstrip("?") for k in KEYS[newer].get(name, ())}


def test_a_sharded_manifest_reads_and_writes_back_byte_for_byte(tmp_path_factory: pytest.TempPathFactory) -> None:
    root = build_sample_shards(tmp_path_factory.mktemp("shards"), formats=("wds", "lmdb"))
    manifest = read_manifest(root)
    assert manifest.splits["train"].lmdb is not None and manifest.splits["train"].index_sha256
    out = tmp_path_factory.mktemp("copy") / MANIFEST_NAME
    write_manifest(out, manifest)
    assert out.read_bytes() == (root / MANIFEST_NAME).read_bytes()


def test_a_manifest_of_the_first_version_reads_and_writes_back_without_the_later_keys(tmp_path: Path) -> None:
    path = tmp_path / MANIFEST_NAME
    path.write_text(json.dumps(_FIRST))
    manifest = read_manifest(tmp_path)
    train = manifest.splits["train"]
    assert (train.reencoded, train.index_version, train.index_sha256, train.lmdb) == (None, None, None, None)
    assert (train.skipped_links, train.empty_classes) == (None, None)
    assert train.rejects == (SkippedInput(source="apple/bad.jpg", reason="not an image"),)
    assert manifest.to_json() == _FIRST


def test_keys_no_record_declares_are_kept(tmp_path: Path) -> None:
    edited = copy.deepcopy(_FIRST)
    edited["written_by"] = {"tool": "other"}
    edited["splits"]["train"]["shards"][0]["note"] = [1, 2]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(edited))
    manifest = read_manifest(tmp_path)
    assert manifest.extra == {"written_by": {"tool": "other"}}
    assert manifest.splits["train"].shards[0].extra == {"note": [1, 2]}
    assert manifest.to_json() == edited


def _with(path: tuple[Any, ...], value: Any) -> dict[str, Any]:
    edited = copy.deepcopy(_FIRST)
    target = edited
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return edited


_TRAIN = ("splits", "train")


@pytest.mark.parametrize(("path", "value", "message"), [
    ((*_TRAIN, "shards", 0, "sha256"), 7, "splits.train.shards[0].sha256: expected a string, got a number"),
    ((*_TRAIN, "rejects", 0, "reason"), None, "splits.train.rejects[0].reason: expected a string, got null"),
    ((*_TRAIN, "per_class", "apple"), "1", "splits.train.per_class.apple: expected an integer, got a string"),
    ((*_TRAIN, "index_sha256"), 1, "splits.train.index_sha256: expected a string, got a number"),
    ((*_TRAIN, "lmdb"), [], "splits.train.lmdb: expected an object, got a list"),
    ((*_TRAIN, "lmdb"), {"path": "train/lmdb"}, "splits.train.lmdb.samples: missing, expected an integer"),
    (("layout",), None, "layout: expected a string, got null"),
])
def test_a_field_of_the_wrong_type_is_refused_naming_its_path(tmp_path: Path, path: tuple, value: Any,
                                                              message: str) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(_with(path, value)))
    with pytest.raises(DataError, match=f"^{re.escape(f'{tmp_path / MANIFEST_NAME}: {message}')}$"):
        read_manifest(tmp_path)


def test_a_key_written_since_the_first_version_is_required(tmp_path: Path) -> None:
    edited = copy.deepcopy(_FIRST)
    del edited["splits"]["train"]["ignored"]
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(edited))
    with pytest.raises(DataError, match=r"manifest\.json: splits\.train\.ignored: missing, expected an integer$"):
        read_manifest(tmp_path)


def test_a_format_version_this_code_does_not_read_is_refused(tmp_path: Path) -> None:
    (tmp_path / MANIFEST_NAME).write_text(json.dumps(_FIRST | {"format_version": max(FORMAT_VERSIONS) + 1}))
    with pytest.raises(DataError, match=f"format_version {max(FORMAT_VERSIONS) + 1}, expected {FORMAT_VERSION}$"):
        read_manifest(tmp_path)
