"""``bench/s3_first_batch.py`` against the session's real S3 server: a daemon on an
empty cache times its first batch from ranged reads, fills the cache over the epoch,
then times a first batch read from the cache (the local-disk reference is left out:
one daemon start less)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench.s3_first_batch import measure, parse_args
from bench.seaweedfs import SeaweedFS
from shards.reader import ShardDataset
from tests.common.s3 import fresh_bucket, pointed_at

pytestmark = pytest.mark.slow


def _train_samples(shards: Path) -> int:
    return len(ShardDataset.open("local", shards).splits["train"])


def test_cold_and_warm_first_batches_are_timed(s3_server: SeaweedFS, bench_shards: Path, tmp_path: Path) -> None:
    args = parse_args(["--batch-size", "4", "--image-size", "32", "--threads", "1", "--trials", "1", "--no-local"])
    with pointed_at(s3_server):
        figures = measure(s3_server, bench_shards, f"s3://{fresh_bucket(s3_server, 'first')}/shards", args, tmp_path)
    (trial,) = figures["trials"]
    assert trial["shards_cached"] == len(list((bench_shards / "train").glob("*.tar")))
    # Every sample of the cold epoch counted, from ranged reads or copies: which way
    # depends on how fast the downloads go beside the reads (tests/feeder/test_remote_faults.py
    # checks that a cold cache's first batch comes from ranged reads, with downloads held back).
    assert trial["cold_epoch_misses"] + trial["cold_epoch_hits"] == _train_samples(bench_shards)
    times = ("cold_first_batch_s", "warm_first_batch_s")
    assert all(trial[key] > 0 for key in times) and figures["median"] == {key: trial[key] for key in times}
