"""Which device a stream's pipeline runs on, and its share of the thread budget
(the device list is given, so this runs without a GPU)."""

from __future__ import annotations

import logging
import threading

import pytest

from core.errors import ConfigError
from core.gpus import GpuInventory
from decode.devices import DevicePlacer, Placement, resolve_device, thread_share
from decode.pipeline import PipelineSpec
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.service import FeederService, open_datasets
from feeder.stream_pipelines import StreamPipelines
from protocol.request import StreamSpec
from shards import jpeg

# As torch prints them (no prefix) and as NVML / nvidia-smi do.
UUIDS = ("GPU-0a1b2c3d-0000-4000-8000-000000000000", "GPU-0a1b2c3d-0000-4000-8000-000000000001")


def test_a_rank_s_gpu_is_found_by_uuid_whichever_way_it_is_written():
    placer = DevicePlacer("gpu", UUIDS)
    assert placer.place(UUIDS[1]) == Placement("gpu", 1, UUIDS[1])
    torch_style = UUIDS[1].removeprefix("GPU-").upper()
    assert placer.place(torch_style) == Placement("gpu", 1, torch_style)
    assert placer.place(UUIDS[0]).device_id == 0


def test_a_cpu_client_runs_on_gpu_0_and_its_batches_leave_the_device():
    assert DevicePlacer("gpu", UUIDS).place("") == Placement("gpu", 0, "")


def test_an_unknown_gpu_falls_back_to_gpu_0_with_one_warning(caplog):
    placer = DevicePlacer("gpu", UUIDS)
    unknown = "GPU-ffffffff-0000-4000-8000-000000000000"
    with caplog.at_level(logging.DEBUG, logger="decode.devices"):
        placements = [placer.place(unknown) for _ in range(3)]
    assert placements == [Placement("gpu", 0, "")] * 3  # no CUDA IPC: the client is not on it
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and unknown in warnings[0].getMessage()


def test_a_cpu_daemon_ignores_the_client_s_gpu():
    placer = DevicePlacer("cpu")
    assert placer.place(UUIDS[0]) == Placement("cpu") and placer.gpu_count == 0


def test_the_daemon_s_device_and_placement_come_from_its_gpu_inventory():
    two, none = GpuInventory.of_uuids(UUIDS), GpuInventory()
    assert resolve_device("auto", two) == "gpu" and resolve_device("auto", none) == "cpu"
    assert resolve_device("cpu", two) == "cpu" and resolve_device("gpu", two) == "gpu"
    with pytest.raises(ConfigError, match="no CUDA device"):
        resolve_device("gpu", none)
    placer = DevicePlacer.of_this_process("gpu", two)
    assert placer.uuids == UUIDS and placer.place(UUIDS[1]) == Placement("gpu", 1, UUIDS[1])
    assert DevicePlacer.of_this_process("cpu", two).gpu_count == 0
    assert DevicePlacer.of_this_process("gpu", none).place(UUIDS[0]) == Placement("gpu", 0)


@pytest.mark.parametrize(("budget", "pipelines", "share"), [
    (8, 1, 8), (8, 2, 4), (8, 3, 2), (8, 8, 1), (8, 20, 1), (1, 4, 1), (8, 0, 8),
])
def test_the_thread_budget_is_split_evenly_at_least_one_each(budget, pipelines, share):
    assert thread_share(budget, pipelines) == share


def test_cpu_spec_has_no_device_index():
    with pytest.raises(ConfigError, match="device_id"):
        PipelineSpec(device="cpu", device_id=1)
    assert PipelineSpec(device="gpu", device_id=1).device_id == 1


def _service(shards, **config) -> FeederService:
    config = ServerConfig.of(datasets={"s": shards}, device="cpu", threads=4, **config)
    return FeederService(config, open_datasets({"s": shards}), ServerMetrics())


@pytest.fixture
def service(shards):
    service = _service(shards)
    yield service
    service.close()


@pytest.fixture
def dali_service(shards):
    """A daemon whose CPU pipelines decode with DALI (threads of their own)."""
    service = _service(shards, cpu_decoder="dali")
    yield service
    service.close()


def _open(service: FeederService, **fields):
    return service.open_stream(StreamSpec(**(dict(dataset="s", split="val", batch_size=4, image_size=32) | fields)))


def test_window_decoder_streams_work_on_the_daemons_threads_alone(service):
    if not jpeg.available():
        pytest.skip(str(jpeg.unavailable_reason()))
    streams = [_open(service, seed=i) for i in range(6)]
    try:
        assert {stream.pipeline.threads for stream in streams} == {1}  # one spec: no threads of their own
        for stream in streams:
            next(iter(stream))
        workers = [t for t in threading.enumerate() if t.name.startswith("feeder-decode")]
        assert len(workers) == service.config.tuning.decode_threads
    finally:
        for stream in streams:
            stream.close()


def test_dali_pipelines_share_the_thread_budget(dali_service):
    first = _open(dali_service)
    second = _open(dali_service)
    try:
        assert (first.pipeline.threads, second.pipeline.threads) == (4, 2)
        assert first.pipeline.device == second.pipeline.device == "cpu"
    finally:
        first.close()
        second.close()


def test_the_ranks_of_a_node_get_equal_shares_whichever_opens_first(dali_service):
    ranks = [_open(dali_service, rank=r, world_size=2, local_world_size=2) for r in range(2)]
    try:
        assert [stream.pipeline.threads for stream in ranks] == [2, 2]
    finally:
        for stream in ranks:
            stream.close()


def test_a_gpu_rank_s_pipeline_is_on_its_gpu_with_a_share_per_gpu(service):
    devices = DevicePlacer("gpu", UUIDS)  # as a daemon with two GPUs sees them
    pipelines = StreamPipelines(service.config, devices, service.parts.pool, None, service.metrics,
                                service.open_streams, lambda reason: None)
    spec = StreamSpec(dataset="s", split="val", batch_size=4, image_size=32)
    on_gpu = pipelines.spec_for(spec, devices.place(UUIDS[1]))
    assert (on_gpu.device, on_gpu.device_id, on_gpu.threads) == ("gpu", 1, 2)  # its node's 2 ranks
    for_cpu_client = pipelines.spec_for(spec, devices.place(""))
    assert (for_cpu_client.device, for_cpu_client.device_id, for_cpu_client.threads) == ("gpu", 0, 4)


def test_the_hardware_jpeg_engines_get_most_of_the_data_from_hopper_on() -> None:
    from decode.devices import hw_decoder_load_for

    assert hw_decoder_load_for(9) == hw_decoder_load_for(10) == hw_decoder_load_for(12) == 0.99  # H100/H200, B200
    assert hw_decoder_load_for(8) == 0.65  # A100: DALI's own default
    placer = DevicePlacer("gpu", UUIDS, majors=[8, 9])
    assert [placer.hw_decoder_load(i) for i in (0, 1)] == [0.65, 0.99]
    assert placer.hw_decoder_load(1, given=0.3) == 0.3  # --hw-decoder-load given: kept
    assert DevicePlacer("gpu", UUIDS).hw_decoder_load(1) == 0.65  # capability not known
