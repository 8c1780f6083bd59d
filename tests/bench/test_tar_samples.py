"""The standard-library reader of a split's JPEG bytes and labels, for the loaders in venvs of their own."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from bench.loaders.tar_samples import manifest_digest, read_samples
from shards.reader import ShardDataset
from tests.common.shards import build_sample_shards


@pytest.fixture(scope="module")
def half_copy_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("tar-samples"), half_copies=True)


def test_the_samples_are_the_bytes_and_labels_the_shard_reader_serves_in_its_order(half_copy_shards: Path) -> None:
    split = ShardDataset.open("bench", half_copy_shards).splits["train"]

    samples = read_samples(half_copy_shards, "train", 10_000)

    assert len(samples) == len(split) > 0
    assert [s.jpeg for s in samples] == [split.read(i).tobytes() for i in range(len(split))]  # no half copies
    assert [s.label for s in samples] == [int(label) for label in split.labels]
    assert [s.key for s in samples] == [str(key) for key in split.keys]


def test_a_limit_takes_the_first_samples_only(half_copy_shards: Path) -> None:
    every = read_samples(half_copy_shards, "train", 10_000)

    assert read_samples(half_copy_shards, "train", 5) == every[:5]
    with pytest.raises(ValueError, match="at least 1"):
        read_samples(half_copy_shards, "train", 0)


def test_an_unknown_split_or_a_folder_without_shards_is_named(half_copy_shards: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'no-such-split' is not in .*manifest.json"):
        read_samples(half_copy_shards, "no-such-split", 1)
    with pytest.raises(FileNotFoundError, match="made by 'feeder shard'"):
        read_samples(tmp_path, "train", 1)


def test_the_manifest_digest_changes_with_the_manifest(half_copy_shards: Path, tmp_path: Path) -> None:
    copy = tmp_path / "shards"
    shutil.copytree(half_copy_shards, copy)
    assert manifest_digest(copy) == manifest_digest(half_copy_shards)

    manifest = json.loads((copy / "manifest.json").read_text())
    manifest["splits"]["train"]["num_samples"] += 1
    (copy / "manifest.json").write_text(json.dumps(manifest))

    assert manifest_digest(copy) != manifest_digest(half_copy_shards)
