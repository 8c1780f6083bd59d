"""A GPU daemon's streams, driven without gRPC: each rank's pipeline on the rank's own
GPU, its batches written device to device into the CUDA IPC ring, no host copy."""

from __future__ import annotations

import logging

import numpy as np
import pytest

from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from protocol.request import StreamSpec
from transport.base import HostIdentity, TransportKind
from transport.daemon import TransportRequest

pytestmark = pytest.mark.gpu

UNKNOWN_GPU = "GPU-00000000-0000-0000-0000-000000000000"


@pytest.fixture
def service(shards):
    config = ServerConfig.of(datasets={"sample": shards}, device="gpu", threads=2, max_batch_size=64, ring_slots=4)
    service = FeederService(config, open_datasets(config.datasets), ServerMetrics())
    yield service
    service.close()


def _rank_on(gpu_uuid: str) -> TransportRequest:
    """What a rank on this host training on ``gpu_uuid`` asks for."""
    return TransportRequest(TransportKind.AUTO, HostIdentity.of_this_process().client_host(gpu_uuid))


def _spec() -> StreamSpec:
    return StreamSpec(dataset="sample", split="val", batch_size=4, image_size=64, max_samples=12)


def _drain(service: FeederService, transport: TransportRequest) -> tuple[object, list[np.ndarray], set]:
    """Every batch of a stream: (its pipeline spec, pixels in host memory, devices)."""
    stream = service.open_stream(_spec(), transport=transport)
    pixels, devices = [], set()
    try:
        for batch in stream:
            stream.encode(batch)  # records a device slot's event, as the servicer does
            images = batch.images
            if isinstance(images, np.ndarray):
                pixels.append(images.copy())
                devices.add("cpu")
            else:
                import torch

                torch.cuda.current_stream(images.device).wait_event(batch.slot.ready)  # the write, on its stream
                pixels.append(images.cpu().numpy())
                devices.add(str(images.device))
            if batch.slot is not None and batch.slot.index >= 0:
                stream.sender.release(batch.slot.index, batch.slot.generation)
        return stream.pipeline, pixels, devices
    finally:
        stream.close()


def test_a_ranks_pipeline_runs_on_its_gpu_and_batches_stay_there(service):
    import torch

    from core.gpus import device_uuid

    for index in sorted({0, torch.cuda.device_count() - 1}):
        pipeline, pixels, devices = _drain(service, _rank_on(device_uuid(index)))
        assert (pipeline.device, pipeline.device_id) == ("gpu", index)
        assert devices == {f"cuda:{index}"} and len(pixels) == 3
        assert all(p.shape == (4, 64, 64, 3) for p in pixels)
    stats = service.metrics.stats()
    assert stats.gpu_batches >= 3 and stats.gpu_host_copies == 0


def test_device_slots_hold_what_host_memory_gets(service):
    from core.gpus import device_uuid

    _, on_device, _ = _drain(service, _rank_on(device_uuid(0)))
    _, on_host, devices = _drain(service, TransportRequest(TransportKind.GRPC))  # a CPU client: GPU 0
    assert devices == {"cpu"} and service.metrics.stats().gpu_host_copies == len(on_host)
    for a, b in zip(on_device, on_host, strict=True):
        assert np.abs(a.astype(np.int16) - b).mean() < 0.5  # same device, same inputs


def test_a_gpu_this_daemon_cannot_see_falls_back_to_gpu_0(service, caplog):
    with caplog.at_level(logging.WARNING, logger="decode.devices"):
        pipeline, pixels, devices = _drain(service, _rank_on(UNKNOWN_GPU))
    assert (pipeline.device, pipeline.device_id) == ("gpu", 0)
    assert devices == {"cpu"} and len(pixels) == 3  # host memory: the client is not on this GPU
    assert UNKNOWN_GPU in caplog.text
