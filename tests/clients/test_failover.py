"""One owner of failover: a pool's share that breaks is reopened at the batch it owes
(not at its old offset), a daemon that refuses what it cannot serve is left to the
others, and ``as-needed`` grows and shrinks without losing an epoch. Each test proves
its fault took place (a counter or a log line), then compares every key with a
fault-free run of the same plan."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from clients import FeederLoader
from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
from tests.common.proxy import TcpProxy
from tests.common.waiting import wait_for

pytestmark = pytest.mark.slow

_KW = dict(split="train", batch_size=4, return_keys=True, normalize=False, seed=1, rank=0, world_size=1,
           prefetch_next_epoch=False)


def _daemon(stack: ExitStack, shards: Path, **options) -> tuple[FeederServer, str]:
    config = ServerConfig.of(datasets={"sample": shards}, port=0, device="cpu", threads=1, grace_s=0.5,
                          **({"max_batch_size": 64} | options))
    server, port = create_server(config)
    stack.callback(lambda: server.stop(0).wait(10))
    return server, f"127.0.0.1:{port}"


def _epoch(loader: FeederLoader, pause_after: int = -1, pause_s: float = 0.0) -> list[str]:
    keys: list[str] = []
    for n, (_, _, batch_keys) in enumerate(loader):
        keys += batch_keys
        if n == pause_after:
            time.sleep(pause_s)
    return keys


@pytest.fixture(scope="module")
def reference(shards: Path) -> Iterator[dict[int, list[str]]]:
    """The keys of epochs 0-3 at 64 px, from one daemon without faults."""
    with ExitStack() as stack:
        _, address = _daemon(stack, shards)
        with FeederLoader("sample", address=address, image_size=64, **_KW) as loader:
            yield {epoch: _epoch(loader) for epoch in range(4)}


def test_a_share_cancelled_for_idleness_resumes_at_the_batch_it_owes(shards, reference):
    # The daemons cancel streams unread for 1 s; the consumer pauses 3 s mid-epoch, so
    # the shares are cancelled (CANCELLED) and reopened. Before: each reopened at its
    # old offset from the cursor after its last batch, repeating and skipping batches.
    with ExitStack() as stack:
        daemons = [_daemon(stack, shards, idle_timeout_s=1.0, contended_idle_timeout_s=1.0) for _ in range(3)]
        # Batches of 1 MB over the gRPC payload: a share the consumer does not read
        # fills its call's flow-control window, and its daemon's stream idles.
        with FeederLoader("sample", address=[a for _, a in daemons], image_size=288, transport="grpc",
                          prefetch_batches=1, **_KW) as loader:
            keys = _epoch(loader, pause_after=4, pause_s=3.0)
            cancelled = sum(server.metrics.registry.get_sample_value("feeder_streams_idle_cancelled_total")
                            for server, _ in daemons)
            assert cancelled >= 1, "the daemons cancelled an idle share"
            assert loader.reconnects >= 1
            assert keys == reference[0]  # the plan's order does not depend on sizes


def test_a_share_whose_connection_is_reset_resumes_at_the_batch_it_owes(shards, reference):
    # A proxy in front of the first daemon (share 0 of 2) resets its connection while
    # the consumer pauses: the share's call fails and is reopened before the consumer
    # is back. Before: the share reopened itself at its old offset, one batch early.
    with ExitStack() as stack:
        _, first = _daemon(stack, shards)
        _, second = _daemon(stack, shards)
        proxy = stack.enter_context(TcpProxy(first))
        # 1 MB batches, one held ahead: the share's call is still streaming when it is
        # cut (with four held ahead, a busy machine once had the share's 16 all sent
        # before the reset, which then cut an idle connection and reopened nothing).
        with FeederLoader("sample", address=[proxy.address, second], image_size=288, transport="grpc",
                          prefetch_batches=1, **_KW) as loader:
            keys: list[str] = []
            for n, (_, _, batch_keys) in enumerate(loader):
                keys += batch_keys
                if n == 3:
                    assert wait_for(lambda: proxy.reset_open() > 0, timeout_s=10)
                    time.sleep(3.0)  # longer than the channel takes to connect again
            assert proxy.resets == 1
            assert keys == reference[0]
            assert loader.reconnects >= 1


def test_a_member_that_refuses_the_request_is_left_and_the_others_serve_it(shards, reference, caplog):
    # The second daemon's --max-batch-size is below the loader's batch: it answers
    # INVALID_ARGUMENT. Before: that ended the job; a pool leaves it instead.
    caplog.set_level(logging.ERROR, logger="clients.pool")
    with ExitStack() as stack:
        _, roomy = _daemon(stack, shards)
        _, small = _daemon(stack, shards, max_batch_size=2)
        with FeederLoader("sample", address=[roomy, small], image_size=64, **_KW) as loader:
            keys, in_use = [], set()
            for _, _, batch_keys in loader:
                keys += batch_keys
                in_use.add(loader.daemons_in_use)
            assert keys == reference[0] and 1 in in_use
    lines = [r.getMessage() for r in caplog.records if small in r.getMessage()]
    assert len(lines) == 1 and "left the pool for good" in lines[0] and "batch_size" in lines[0], lines


def test_as_needed_takes_the_second_daemon_and_keeps_every_epoch_whole(shards, reference):
    # A consumer that never waits on itself: the pool takes its second daemon after a
    # settling window and one of waiting (5 s each). Before: the epoch in which it did
    # delivered 1 batch, every later one none, silently.
    with ExitStack() as stack:
        addresses = [_daemon(stack, shards)[1] for _ in range(2)]
        kw = _KW | dict(seed=1, prefetch_next_epoch=True)
        with FeederLoader("sample", address=addresses, image_size=64, pool="as-needed", **kw) as loader:
            in_use, started = [], time.monotonic()
            epoch = 0
            while epoch < 4 or (in_use[-2:] != [2, 2] and time.monotonic() - started < 60):
                keys = _epoch(loader)
                if epoch in reference:
                    assert keys == reference[epoch], epoch
                assert len(keys) == len(reference[0]), epoch
                in_use.append(loader.daemons_in_use)
                epoch += 1
            assert in_use[-1] == 2, in_use
