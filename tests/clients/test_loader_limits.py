"""FeederLoader against a daemon's limits: a loader whose stream the daemon cancels
for idleness resumes at its cursor and loses nothing."""

from __future__ import annotations

import time
from collections import Counter

import pytest

from clients import FeederLoader
from feeder.config import ServerConfig
from feeder.server import create_server
from tests.common.sample_daemon import N_TRAIN

pytestmark = pytest.mark.slow


def test_a_loader_paused_past_the_idle_timeout_resumes_without_loss(shards):
    config = ServerConfig.of(datasets={"sample": shards}, port=0, device="cpu", threads=1, max_batch_size=64,
                          grace_s=0.5, idle_timeout_s=1.0)
    server, port = create_server(config)
    try:
        # 32 batches to the epoch, of 2.4 MB each: what a paused loader's buffers take
        # (its queue, gRPC's windows, the daemon's send) is 4-6 batches here, 10 once
        # in a fresh make test (with batches of 16, 10 was all of the epoch and nothing
        # was left to resume); so the daemon's stream waits on the paused loader, is
        # cancelled, and the loader reconnects for the rest of its epoch.
        with FeederLoader(address=f"127.0.0.1:{port}", dataset="sample", batch_size=4, image_size=448, rank=0,
                          world_size=1, return_keys=True, prefetch_batches=1, transport="grpc") as loader:
            seen: Counter[str] = Counter()
            for i, (_, _, keys) in enumerate(loader):
                seen.update(keys)
                if i == 0:
                    time.sleep(4.0)  # a long evaluation or checkpoint
            assert server.metrics.registry.get_sample_value("feeder_streams_idle_cancelled_total") >= 1
            assert loader.reconnects >= 1
            assert sum(seen.values()) == N_TRAIN and set(seen.values()) == {1}
    finally:
        server.stop(0).wait(10)
