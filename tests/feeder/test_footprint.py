"""The daemon's whole footprint is bounded by its budgets: resident memory under load
stays within max_memory_bytes + shm_budget_bytes + decoded_cache_bytes + the
libraries (``ServerConfig.footprint_bytes``)."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from feeder.config import ServerConfig
from launcher.daemon_process import DaemonProcess
from protos import feeder_pb2, feeder_pb2_grpc
from transport.base import HostIdentity

pytestmark = pytest.mark.slow


def _peak_rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmHWM")


def test_resident_memory_under_load_stays_within_the_footprint(shards: Path):
    # The budget admits the three streams below (206 MiB each at 224 px, batch 64) and no fourth.
    options = ("--threads", "2", "--max-memory-bytes", "660M", "--shm-budget-bytes", "256M", "--decoded-cache-bytes",
               "64M", "--max-batch-size", "64")
    config = ServerConfig.of(datasets={"s": shards}, max_memory_bytes=660 << 20, shm_budget_bytes=256 << 20,
                          decoded_cache_bytes=64 << 20)
    with DaemonProcess({"sample": shards}, options) as daemon:
        with grpc.insecure_channel(daemon.address, options=[("grpc.max_receive_message_length", -1)]) as channel:
            stub = feeder_pb2_grpc.FeederStub(channel)
            host = HostIdentity.of_this_process().client_host().to_message()
            calls = [stub.StreamBatches(feeder_pb2.StreamRequest(
                dataset="sample", split="train", world_size=1, batch_size=64, image_size=224, epochs=10,
                transport=transport, client_host=host))
                for transport in (feeder_pb2.TRANSPORT_SHM, feeder_pb2.TRANSPORT_GRPC, feeder_pb2.TRANSPORT_SHM)]
            taken = [len(list(call)) for call in calls]  # read to the end, all three at once in gRPC's queues
        peak = _peak_rss_bytes(daemon.pid)
    assert taken == [10, 10, 10]
    assert peak <= config.footprint_bytes, (peak >> 20, config.footprint_bytes >> 20)
