"""``feeder serve --dataset NAME=s3://bucket/prefix`` against a real S3 server: the
same batches, pixels and labels as from the local copy; a bucket, manifest,
credentials or endpoint that do not work stop the daemon with one line naming the
URL and the reason, exit 1; the store's counters are in GetStats and Prometheus."""

from __future__ import annotations

import urllib.request
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from typer.testing import CliRunner

from bench.seaweedfs import SeaweedFS
from cli.app import app
from protos import feeder_pb2, feeder_pb2_grpc
from shards.layout import index_path
from tests.common.bad_samples import copy_shards
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree
from tests.feeder.conftest import connect, request, start


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, shards: Path) -> str:
    return upload_tree(s3_server, shards, f"s3://{fresh_bucket(s3_server, 'serve')}/sample")


def _fields(batch) -> tuple:
    return tuple(batch.keys), tuple(batch.labels), tuple(batch.padding), batch.images


@pytest.mark.slow
def test_a_remote_dataset_serves_the_batches_of_its_local_copy(s3_server: SeaweedFS, shards: Path, remote: str) -> None:
    with pointed_at(s3_server):
        server, port = start({"remote": remote, "local": shards}, s3_endpoint=s3_server.endpoint_url, metrics_port=0)
    try:
        with connect(port) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            for split in ("train", "val"):
                fields = dict(split=split, batch_size=4, image_size=16, seed=3)
                there = [_fields(b) for b in stub.StreamBatches(request(dataset="remote", **fields))]
                here = [_fields(b) for b in stub.StreamBatches(request(dataset="local", **fields))]
                assert there == here and len(there) > 1
            stats = stub.GetStats(feeder_pb2.StatsRequest())
            assert stats.store_requests > 0 and stats.store_bytes_fetched > 0 and stats.shard_cache_budget_bytes == 0
            names = {d.name for d in stub.ListDatasets(feeder_pb2.ListDatasetsRequest()).datasets}
            assert names == {"remote", "local"}
        scraped = urllib.request.urlopen(f"http://127.0.0.1:{server.metrics_port}/metrics", timeout=10).read().decode()
        assert "feeder_store_requests_total" in scraped and "feeder_store_bytes_fetched_total" in scraped
    finally:
        server.stop(0).wait(10)


def _serve(*args: str):
    return CliRunner().invoke(app, ["serve", "--port", "0", "--device", "cpu", *args])


def _one_line(result) -> str:
    assert result.exit_code == 1, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_a_missing_bucket_or_manifest_stops_the_daemon_with_one_line(s3_server: SeaweedFS, remote: str) -> None:
    bucket = remote.split("/")[2]
    with pointed_at(s3_server):
        missing_bucket = _one_line(_serve("--dataset", "x=s3://no-such-bucket-y/sample"))
        missing_manifest = _one_line(_serve("--dataset", f"x=s3://{bucket}"))
    assert missing_bucket.startswith("feeder: not found: s3://no-such-bucket-y/sample: does not exist (404")
    assert missing_manifest.startswith(f"feeder: not found: s3://{bucket}/manifest.json does not exist")


def test_refused_credentials_stop_the_daemon_with_one_line(s3_server: SeaweedFS, remote: str) -> None:
    with pointed_at(s3_server, AWS_ACCESS_KEY_ID="nobody"):
        line = _one_line(_serve("--dataset", f"x={remote}"))
    assert line.startswith(
        f"feeder: not authenticated: {remote}: the store refused access (403 Forbidden (InvalidAccessKeyId))"
    )


@pytest.mark.slow
def test_an_unreachable_endpoint_stops_the_daemon_with_one_line(s3_server: SeaweedFS, remote: str) -> None:
    with pointed_at(s3_server):
        line = _one_line(_serve("--dataset", f"x={remote}", "--s3-endpoint", "http://127.0.0.1:1"))
    assert line.startswith(f"feeder: unavailable: {remote}: the store did not answer for ")
    assert "endpoint http://127.0.0.1:1" in line


def test_a_bad_store_url_or_endpoint_is_one_line(tmp_path: Path) -> None:
    assert "s3://b/a/../x" in _one_line(_serve("--dataset", "x=s3://b/a/../x"))
    assert _one_line(_serve("--dataset", f"x={tmp_path}", "--s3-endpoint", "127.0.0.1:9000")) == (
        "feeder: error: s3_endpoint: '127.0.0.1:9000' is not an http:// or https:// URL")


def test_a_remote_index_changed_after_sharding_stops_the_daemon_with_one_line(s3_server: SeaweedFS, shards: Path,
                                                                             tmp_path: Path) -> None:
    # The index's sha256 is checked against the manifest's, as from local disk: before,
    # a remote index with its labels permuted was served (half the samples mislabelled).
    copy = copy_shards(shards, tmp_path / "permuted")
    path = index_path(copy, "train")
    table = pq.read_table(path)
    labels = table.column("label").to_pylist()
    pq.write_table(table.set_column(table.schema.get_field_index("label"), "label",
                                    pa.array(labels[1:] + labels[:1])), path)
    url = upload_tree(s3_server, copy, f"s3://{fresh_bucket(s3_server, 'permuted')}/sample")
    with pointed_at(s3_server):
        line = _one_line(_serve("--dataset", f"x={url}", "--s3-endpoint", s3_server.endpoint_url))
    assert line.startswith(f"feeder: bad data: {url}/train/index.parquet: sha256 "), line
    assert "the manifest's index_sha256 is" in line
