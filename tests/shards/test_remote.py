"""A shard directory in an object store (a real S3 server) reads as the local one it
was copied from: the same checks at open, the same bytes, batches fetched in merged
ranged GETs, and what the store refuses named with its URL and the sample's key."""

from __future__ import annotations

import gc
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from bench.seaweedfs import SeaweedFS
from core.errors import NotFound, SampleCorrupt, SamplesUnreadable, ServiceUnavailable, Unauthenticated
from shards.ranged import MERGE_GAP_BYTES, RemoteAccess, merged_spans
from shards.reader import ShardDataset
from shards.sources import Extent
from shards.store import StoreCounters, StoreOptions
from tests.common.proxy import TcpProxy
from tests.common.s3 import fresh_bucket, pointed_at, store_of, upload_tree
from tests.common.shards import build_sample_shards
from tests.common.waiting import wait_for


@pytest.fixture(scope="module")
def local(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("remote-source"), half_copies=True)


@pytest.fixture(scope="module")
def remote(s3_server: SeaweedFS, local: Path) -> str:
    return upload_tree(s3_server, local, f"s3://{fresh_bucket(s3_server)}/shards/imagenet")


def _open(server: SeaweedFS, url: str, endpoint: str | None = None, **options: float) -> ShardDataset:
    access = RemoteAccess(StoreOptions(endpoint_url=endpoint or server.endpoint_url, **options), StoreCounters())
    with pointed_at(server):
        return ShardDataset.open("remote", url, remote=access)


def _requests(split) -> int:
    return split._bytes._store.counters.snapshot()["requests"]


@pytest.mark.slow
def test_a_remote_root_reads_the_same_samples_as_the_local_one(s3_server: SeaweedFS, local: Path, remote: str) -> None:
    there, here = _open(s3_server, remote), ShardDataset.open("local", local)
    assert str(there.root) == remote and there.classes == here.classes and set(there.splits) == set(here.splits)
    for name, split in there.splits.items():
        mine = here.splits[name]
        assert split.keys == mine.keys and np.array_equal(split.labels, mine.labels)
        rows = np.arange(len(split))
        assert all(np.array_equal(a, b) for a, b in zip(split.read_many(rows), mine.read_many(rows)))
        copies = rows[split.half_copies]
        assert len(copies)
        halves = np.ones(len(copies), bool)
        pairs = zip(split.read_many(copies, halves), mine.read_many(copies, halves))
        assert all(np.array_equal(a, b) for a, b in pairs)
        assert str(split.shard_paths[0]) == f"{remote}/{mine.shard_of(0)}"


def test_neighbouring_samples_come_in_one_request_per_shard(s3_server: SeaweedFS, remote: str) -> None:
    split = _open(s3_server, remote).splits["val"]
    rows = np.arange(len(split))  # in write order: consecutive bytes of each tar
    shards = {split.shard_of(int(i)) for i in rows}
    before = _requests(split)
    split.read_many(rows)
    assert _requests(split) - before == len(shards) < len(rows)


def test_spans_merge_close_ranges_only_and_within_a_size() -> None:
    extents = [Extent(0, 0, 100), Extent(0, 150, 100), Extent(0, 150 + MERGE_GAP_BYTES + 200, 10), Extent(0, 5, 10)]
    assert [(s.start, s.end, sorted(s.members)) for s in merged_spans(extents, range(4))] == [
        (0, 250, [0, 1, 3]), (MERGE_GAP_BYTES + 350, MERGE_GAP_BYTES + 360, [2])]
    assert len(merged_spans(extents, [0, 1], max_bytes=200)) == 2


def test_read_ahead_fetches_the_next_batch_before_it_is_read(s3_server: SeaweedFS, remote: str) -> None:
    split = _open(s3_server, remote).splits["train"]
    rows = np.random.default_rng(0).permutation(len(split))[:8]
    split.will_need(rows)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and any(not a.future.done() for _, a in split._bytes._ahead_order):
        time.sleep(0.01)
    requested = _requests(split)
    images, copies = rows[:4], rows[4:]
    split.read_many(images)
    split.read_many(copies, split.half_copies[copies])
    assert _requests(split) == requested  # every byte was already on its way


def test_a_read_ahead_is_let_go_once_read_and_never_fetched_twice(s3_server: SeaweedFS, remote: str) -> None:
    # Before: read-ahead was kept until newer read-ahead filled its budget, so a later
    # epoch's reads took an earlier epoch's bytes from memory while their own
    # read-ahead fetched the same bytes again, to be counted whenever it ended.
    split = _open(s3_server, remote).splits["train"]
    rows = np.random.default_rng(2).permutation(len(split))[:8]
    split.will_need(rows)
    ahead = [a.future for _, a in split._bytes._ahead_order]
    split.will_need(rows[:4])  # already on its way: not fetched again
    assert ahead and [a.future for _, a in split._bytes._ahead_order] == ahead
    split.read_many(rows[:4])
    assert split._bytes._ahead_order, "kept for the samples not read yet"
    split.read_many(rows[4:])
    assert not split._bytes._ahead_order
    for future in ahead:
        future.result(timeout=20)
    requested = _requests(split)
    split.read_many(rows)
    assert _requests(split) > requested  # read from the store again, not from memory


@pytest.mark.slow
def test_a_read_ahead_that_failed_is_never_handed_to_a_later_read(s3_server: SeaweedFS, own_copy: str) -> None:
    # Before: read-aheads that failed while the store was down were kept and handed to
    # the reads of the next batches, which failed at once after the store was back.
    split = _open(s3_server, own_copy, retry_window_s=0.3).splits["train"]
    rows = np.random.default_rng(1).permutation(len(split))[:8]
    s3_server.stop(kill=True)
    try:
        split.will_need(rows)
        ahead = [a.future for _, a in split._bytes._ahead_order]
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not all(f.done() for f in ahead):
            time.sleep(0.05)
        assert ahead and all(f.exception() is not None for f in ahead), "the read-ahead failed"
    finally:
        s3_server.start()
    split.will_need(rows)  # the store is back: read ahead again, beside the failed ones
    again = [a.future for _, a in split._bytes._ahead_order if a.future not in ahead]
    assert again and all(f.result(timeout=20) is not None for f in again)
    requested = _requests(split)
    assert len(split.read_many(rows)) == len(rows)
    assert _requests(split) == requested, "read from the read-ahead made once the store was back"
    assert not split._bytes._ahead_order, "nothing kept once read"


def test_a_missing_bucket_manifest_or_directory_is_not_found_naming_the_url(s3_server: SeaweedFS, remote: str) -> None:
    bucket = remote.split("/")[2]
    with pytest.raises(NotFound, match=r"^s3://no-such-bucket-x/shards: does not exist \(404 Not Found \(NoSuchBucket"):
        _open(s3_server, "s3://no-such-bucket-x/shards")
    with pytest.raises(NotFound, match=rf"^s3://{bucket}/shards/nothing: no such shard directory"):
        _open(s3_server, f"s3://{bucket}/shards/nothing")
    with pytest.raises(NotFound, match=rf"^s3://{bucket}/shards/manifest.json does not exist"):
        _open(s3_server, f"s3://{bucket}/shards")


def test_refused_credentials_are_unauthenticated_naming_the_url(s3_server: SeaweedFS, remote: str) -> None:
    access = RemoteAccess(StoreOptions(endpoint_url=s3_server.endpoint_url), StoreCounters())
    with pointed_at(s3_server, AWS_SECRET_ACCESS_KEY="not-the-secret"), \
            pytest.raises(Unauthenticated, match=rf"^{remote}: the store refused access \(403 Forbidden"):
        ShardDataset.open("remote", remote, remote=access)


@pytest.mark.slow
def test_an_unreachable_endpoint_is_unavailable_soon_naming_it(s3_server: SeaweedFS, remote: str) -> None:
    # Reads retry for an hour here: an open that waited as long as they do would meet
    # the test's timeout instead of its few seconds of retries.
    with pytest.raises(ServiceUnavailable, match=rf"^{remote}: the store did not answer .*endpoint http://127.0.0.1:1\)"):
        _open(s3_server, remote, endpoint="http://127.0.0.1:1", retry_window_s=3600.0)


@pytest.fixture()
def own_copy(s3_server: SeaweedFS, local: Path) -> str:
    """A remote copy this test may damage."""
    return upload_tree(s3_server, local, f"s3://{fresh_bucket(s3_server, 'own')}/shards")


def test_a_shard_deleted_after_open_names_its_url_and_every_sample_of_it(
        s3_server: SeaweedFS, own_copy: str) -> None:
    split = _open(s3_server, own_copy).splits["val"]
    rows = np.arange(len(split))
    gone = split.shard_of(0)
    store_of(s3_server, own_copy).delete([gone])
    with pytest.raises(SamplesUnreadable) as caught:
        split.read_many(rows)
    refused = caught.value.samples
    assert {s.index for s in refused} == {int(i) for i in rows if split.shard_of(int(i)) == gone}
    assert {s.url for s in refused} == {f"{own_copy}/{gone}"}
    assert all("404 Not Found" in s.reason for s in refused)
    assert str(caught.value).startswith(f"{own_copy}/{gone}: sample {split.keys[0]} cannot be read")


def test_a_shard_shorter_than_its_index_names_the_samples_past_its_end(
        s3_server: SeaweedFS, local: Path, own_copy: str) -> None:
    split = _open(s3_server, own_copy).splits["val"]
    shard = split.shard_of(0)
    rows = np.array([i for i in range(len(split)) if split.shard_of(i) == shard])
    cut = split.location(int(rows[-1]))[0] + 10  # inside the last sample
    store_of(s3_server, own_copy).put_bytes(shard, (local / shard).read_bytes()[:cut])
    with pytest.raises(SamplesUnreadable) as caught:
        split.read_many(rows)
    assert [s.index for s in caught.value.samples] == [int(rows[-1])]
    assert "the object ends at byte" in caught.value.samples[0].reason
    assert len(split.read_many(rows[:-1])) == len(rows) - 1


def test_a_shard_rewritten_with_other_bytes_is_corrupt_naming_its_url(
        s3_server: SeaweedFS, local: Path, own_copy: str) -> None:
    split = _open(s3_server, own_copy).splits["val"]
    shard = split.shard_of(0)
    data = bytearray((local / shard).read_bytes())
    offset, size = split.location(0)
    data[offset:offset + size] = bytes(size)
    store_of(s3_server, own_copy).put_bytes(shard, bytes(data))
    with pytest.raises(SampleCorrupt, match=rf"^{own_copy}/{shard}: sample {split.keys[0]} differs") as caught:
        split.read(0)
    assert caught.value.path.name == Path(shard).name


def test_connection_resets_are_retried_and_counted(s3_server: SeaweedFS, remote: str) -> None:
    proxy = TcpProxy(s3_server.endpoint)
    try:
        split = _open(s3_server, remote, endpoint=proxy.url).splits["val"]
        counters = split._bytes._store.counters
        proxy.reset_next(3)
        before = counters.snapshot()["retries"]
        assert len(split.read_many(np.arange(4))) == 4
        assert counters.snapshot()["retries"] - before >= 1
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_store_that_stops_answering_is_unavailable_after_the_retry_window(s3_server: SeaweedFS, remote: str) -> None:
    proxy = TcpProxy(s3_server.endpoint)
    try:
        split = _open(s3_server, remote, endpoint=proxy.url, retry_window_s=1.0, request_timeout_s=0.5).splits["val"]
        proxy.freeze()
        with pytest.raises(ServiceUnavailable, match="the store did not answer for"):
            split.read_many(np.arange(2))
    finally:
        proxy.close()


def test_one_datasets_stuck_store_does_not_hold_another_datasets_reads(s3_server: SeaweedFS, remote: str) -> None:
    proxy = TcpProxy(s3_server.endpoint)
    try:
        # Its requests wait an hour on the frozen store: reads held behind them would
        # meet the test's timeout. Once the proxy closes, they fail at once.
        stuck = _open(s3_server, remote, endpoint=proxy.url, request_timeout_s=3600.0,
                      retry_window_s=0.0).splits["train"]
        free = _open(s3_server, remote).splits["train"]
        proxy.freeze()
        stuck.will_need(np.arange(len(stuck)))  # every thread of its pool waits on the frozen store
        assert len(free.read_many(np.arange(len(free)))) == len(free)
        waiting = [a.future for _, a in stuck._bytes._ahead_order]
        assert waiting and not any(f.done() for f in waiting)  # the other's reads were stuck all along
    finally:
        proxy.close()


@pytest.mark.slow
def test_a_datasets_request_threads_serve_its_splits_and_end_with_them(s3_server: SeaweedFS, remote: str) -> None:
    def threads() -> int:
        return sum(t.name.startswith("feeder-get-short-lived-") for t in threading.enumerate())

    access = RemoteAccess(StoreOptions(endpoint_url=s3_server.endpoint_url), StoreCounters(), max_requests=3)
    with pointed_at(s3_server):
        split = ShardDataset.open("short-lived", remote, remote=access).splits["val"]  # the dataset itself is gone
    gc.collect()
    assert threads() == 3 and len(split.read_many(np.arange(4))) == 4
    del split
    gc.collect()
    deadline = time.monotonic() + 10
    while threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threads() == 0


@pytest.mark.slow
def test_a_stopping_daemon_ends_the_waits_between_retries_at_once(s3_server: SeaweedFS, remote: str) -> None:
    # Before: a retry's sleep could not be cut short: a stopping daemon's reads retried
    # against a dead store for the whole retry window.
    # Retried for an hour: a reader that went on to the end of its window would still
    # be alive long after the join's minute.
    proxy, counters = TcpProxy(s3_server.endpoint), StoreCounters()
    access = RemoteAccess(StoreOptions(endpoint_url=proxy.url, retry_window_s=3600.0, first_backoff_s=2.0,
                                       max_backoff_s=2.0), counters)
    with pointed_at(s3_server):
        split = ShardDataset.open("remote", remote, remote=access).splits["val"]
    proxy.reset_next(10_000)  # every connection refused from now on
    retried = counters.snapshot().get("retries", 0)
    failed: list[BaseException] = []
    reader = threading.Thread(target=lambda: _read_into(split, failed), daemon=True)
    reader.start()
    assert wait_for(lambda: counters.snapshot().get("retries", 0) > retried)  # it waits between retries
    access.stopping.set()
    reader.join(60)
    proxy.close()
    assert not reader.is_alive()
    assert failed and "the daemon is stopping" in str(failed[0])


def _read_into(split, failed: list[BaseException]) -> None:
    try:
        split.read(0)
    except BaseException as e:  # noqa: BLE001 - what the reader ends with
        failed.append(e)


def test_bytes_read_ahead_before_an_object_was_put_right_are_fetched_again(
        s3_server: SeaweedFS, local: Path, own_copy: str) -> None:
    # Found by the fault schedule (seed 9): a read-ahead made while a shard was a corrupt
    # copy, read after the original was back, failed its checksum and the sample was
    # replaced although the store had the right bytes.
    split = _open(s3_server, own_copy).splits["val"]
    shard = split.shard_of(0)
    rows = np.array([i for i in range(len(split)) if split.shard_of(i) == shard])
    store = store_of(s3_server, own_copy)
    original = (local / shard).read_bytes()
    store.put_bytes(shard, bytes(b ^ 0x5A for b in original))
    split.will_need(rows)
    ahead = [a.future for _, a in split._bytes._ahead_order]
    assert ahead  # the shard's bytes were read ahead while it was the corrupt copy
    for future in ahead:
        future.result(timeout=20)  # the corrupt bytes, read ahead
    store.put_bytes(shard, original)
    here = ShardDataset.open("local", local).splits["val"]
    assert all(np.array_equal(a, b) for a, b in zip(split.read_many(rows), here.read_many(rows)))
