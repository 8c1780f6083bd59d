"""``feeder shard s3://bucket/prefix OUT`` against a real S3 server (SeaweedFS): a
prefix holding the folder tree, or the image-net.org tars, shards to the bytes of
the same files on a local disk."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from bench.seaweedfs import SeaweedFS
from cli.app import app
from sharder import ShardConfig, shard
from sharder.download_tars import TRAIN_TAR
from sharder.source_reads import read_input
from sharder.sources import find_sources
from tests.common.s3 import fresh_bucket, pointed_at, store_of, upload_tree
from tests.sharder.downloads import build_download, same_output

SHARD_BYTES = 40_000


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the sample tree, its image-net.org download)."""
    return build_download(tmp_path_factory.mktemp("store-sources"), classes=3, train_per_class=6, val_per_class=2)


def _config(src: Path | str, out: Path, server: SeaweedFS, **options) -> ShardConfig:
    return ShardConfig(src, out, seed=9, shard_size_bytes=SHARD_BYTES, s3_endpoint=server.endpoint_url, **options)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tree", "tars"])
def test_a_store_prefix_shards_to_the_bytes_of_its_local_copy(
        s3_server: SeaweedFS, local: tuple[Path, Path], tmp_path: Path, layout: str) -> None:
    src = local[0] if layout == "tree" else local[1]
    url = upload_tree(s3_server, src, f"s3://{fresh_bucket(s3_server)}/imagenet")
    shard(_config(src, tmp_path / "local", s3_server))
    with pointed_at(s3_server):
        report = shard(_config(url, tmp_path / "store", s3_server, workers=2))  # workers read the store too
    same_output(tmp_path / "local", tmp_path / "store")
    assert report.total("accepted") == 24 and report.total("rejected") == 0


def test_a_member_read_by_its_range_names_its_url(s3_server: SeaweedFS, local: tuple[Path, Path]) -> None:
    url = upload_tree(s3_server, local[1], f"s3://{fresh_bucket(s3_server)}/download")
    with pointed_at(s3_server):
        tree = find_sources(url)
        (first, *_), reader = tree.splits[0].files, tree.splits[0].reader
        data = reader.read(first.source)
    assert data == (local[0] / first.source).read_bytes()
    wnid = first.source.split("/")[1]
    assert reader.shown(first.source) == f"{url}/{TRAIN_TAR}/{wnid}.tar/{first.source.rpartition('/')[2]}"


def test_a_store_object_gone_since_the_listing_is_a_reject_naming_it(
        s3_server: SeaweedFS, local: tuple[Path, Path], tmp_path: Path) -> None:
    url = upload_tree(s3_server, local[0], f"s3://{fresh_bucket(s3_server)}/tree")
    with pointed_at(s3_server):
        tree = find_sources(url)
        gone = tree.splits[0].files[0].source
        store_of(s3_server, url).delete([gone])
        outcome = read_input(tree.splits[0].reader, gone)
    assert not isinstance(outcome, bytes) and outcome.reject.startswith("unreadable: ")


def test_an_empty_prefix_is_one_line_naming_it(s3_server: SeaweedFS, tmp_path: Path) -> None:
    url = f"s3://{fresh_bucket(s3_server)}/nothing"
    with pointed_at(s3_server):
        result = CliRunner().invoke(app, ["shard", url, str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 1
    assert result.stderr.splitlines() == [f"feeder: not found: SRC {url} holds no objects"]
