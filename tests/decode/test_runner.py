"""The runner on synthetic JPEGs, with each decoder of the CPU path: shapes and dtype,
per-run sizes, windows and flips, outcomes in order with failures named as data."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from core.errors import ConfigError
from decode.augment import Crops, key_hashes, random_resized_crops
from decode.jobs import Decoded, Failed, Job, SampleDecodeError
from decode.pipeline import PipelineSpec
from decode.runner import PipelineRunner
from protocol.request import AugmentKind, CropRange
from shards import jpeg
from tests.common.jobs import header_job, jpeg_bytes
from transport.base import Slot


@pytest.fixture(params=["libjpeg-turbo", "dali"])
def cpu_decoder(request: pytest.FixtureRequest) -> str:
    """The CPU path runs with either decoder (libjpeg-turbo where it was built)."""
    if request.param == "libjpeg-turbo" and not jpeg.available():
        pytest.skip(str(jpeg.unavailable_reason()))
    return request.param


@pytest.fixture(scope="module")
def jpegs() -> list[np.ndarray]:
    return [jpeg_bytes(60 + 13 * i, 90 - 5 * i, i) for i in range(9)]


def _runner(cpu_decoder: str, max_batch_size: int = 8, **spec) -> PipelineRunner:
    return PipelineRunner(PipelineSpec(cpu_decoder=cpu_decoder, max_batch_size=max_batch_size, threads=1, **spec))


def _unreadable_scan(data: np.ndarray) -> np.ndarray:
    raw = bytearray(data.tobytes())
    raw[raw.index(b"\xff\xda") + 6] = 0x33  # the scan asks for Huffman tables the file lacks
    return np.frombuffer(bytes(raw), np.uint8)


@pytest.mark.parametrize("kind", list(AugmentKind))
def test_batch_and_image_size_change_per_run(kind, jpegs, cpu_decoder):
    runner = _runner(cpu_decoder)
    first = runner.run(header_job(jpegs[:3], 32, kind))
    assert first.shape == (3, 32, 32, 3) and first.dtype == np.uint8
    jobs = [header_job(jpegs[:8], 48, kind), header_job(jpegs[5:6], 16, kind), header_job(jpegs[1:6], 224, kind)]
    outs = [o.slot.array for o in runner.run_many(jobs) if isinstance(o, Decoded)]
    assert [o.shape for o in outs] == [(8, 48, 48, 3), (1, 16, 16, 3), (5, 224, 224, 3)]


def test_val_is_a_centre_crop_of_the_resized_image(cpu_decoder):
    # Left half black, right half white: the centre crop keeps both, symmetric.
    pixels = np.zeros((80, 160, 3), dtype=np.uint8)
    pixels[:, 80:] = 255
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    (image,) = _runner(cpu_decoder, 2).run(header_job([np.frombuffer(out.getvalue(), np.uint8)], 64))
    assert image[:, :20].mean() < 20 and image[:, -20:].mean() > 235


def test_the_same_job_makes_the_same_pixels(jpegs, cpu_decoder):
    job = header_job(jpegs[:4], 40, AugmentKind.TRAIN, seed=7)
    assert np.array_equal(_runner(cpu_decoder, 4).run(job), _runner(cpu_decoder, 4).run(job))


def test_train_mirrors_where_the_flips_say(cpu_decoder):
    # Left half white, right half black; a full-image crop keeps that or mirrors it.
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    pixels[:, :32] = 255
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    data = np.frombuffer(out.getvalue(), dtype=np.uint8)
    whole = CropRange(min_scale=1.0, max_scale=1.0, min_ratio=1.0, max_ratio=1.0)
    side = np.full(64, 64)
    crops = random_resized_crops(3, 0, key_hashes([str(i) for i in range(64)]), side, side, whole)
    images = _runner(cpu_decoder, 64).run(Job([data] * 64, 32, crops)).astype(np.int32)
    left, right = images[:, :, :16].mean(axis=(1, 2, 3)), images[:, :, 16:].mean(axis=(1, 2, 3))
    assert np.all(np.abs(left - right) > 200)  # each image is the original or its mirror
    assert 12 <= int((left < right).sum()) <= 52  # coin flip with p = 0.5 over 64 samples
    assert np.array_equal(left < right, crops.flips)


def test_windows_are_decoded_where_the_crops_say(cpu_decoder):
    # A 4x4 grid of flat colours: a window on one cell gives that colour only.
    pixels = np.zeros((128, 128, 3), dtype=np.uint8)
    for row in range(4):
        for col in range(4):
            pixels[32 * row:32 * (row + 1), 32 * col:32 * (col + 1)] = (60 * row, 60 * col, 128)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=98)
    data = np.frombuffer(out.getvalue(), np.uint8)
    crops = Crops(boxes=np.array([[36, 4, 24, 24], [68, 100, 24, 24]], dtype=np.int32), flips=np.array([False, True]))
    for antialias in (False, True):
        images = _runner(cpu_decoder, 2, antialias=antialias).run(Job([data, data], 16, crops))
        images = images.reshape(2, -1, 3).astype(int)
        assert np.abs(images[0] - (0, 60, 128)).max() <= 4
        assert np.abs(images[1] - (180, 120, 128)).max() <= 4


def test_crops_must_match_the_batch(jpegs, cpu_decoder):
    crops = Crops(boxes=np.array([[0, 0, 8, 8]], np.int32), flips=np.zeros(1, bool))
    with pytest.raises(ConfigError, match="crops"):
        list(_runner(cpu_decoder, 4).run_many([Job(jpegs[:2], 16, crops)]))


def test_a_failed_run_names_its_sample_and_the_runner_goes_on(jpegs, cpu_decoder):
    runner = _runner(cpu_decoder, 4)
    bad = [jpegs[0], _unreadable_scan(jpegs[1]), jpegs[2], np.frombuffer(b"not a jpeg" * 10, np.uint8)]
    with pytest.raises(SampleDecodeError) as caught:
        runner.run(header_job(bad, 32))
    # libjpeg-turbo names every failing sample; here DALI names none, and each is tried alone.
    assert caught.value.positions == (1, 3) and not runner.broken
    assert runner.run(header_job(jpegs[:3], 32)).shape == (3, 32, 32, 3)


def test_outcomes_come_out_in_order_and_a_repair_runs_alone_before_the_rest(jpegs, cpu_decoder):
    runner = PipelineRunner(PipelineSpec(cpu_decoder=cpu_decoder, max_batch_size=4, threads=1, prefetch=2))
    bad = _unreadable_scan(jpegs[5])
    jobs = [header_job(j, 24) for j in (jpegs[0:3], [jpegs[3], bad, bad], jpegs[6:9], [bad])]
    got, failures = [], []
    for outcome in runner.run_many(jobs):
        while isinstance(outcome, Failed):  # the caller's policy: the first image in place of each failure
            failures.append(outcome.error.positions)
            job = outcome.job
            repaired = [jpegs[0] if i in outcome.error.failures else j for i, j in enumerate(job.jpegs)]
            outcome = runner.run_alone(header_job(repaired, 24))
        got.append(outcome.slot.array.copy())
    clean = [header_job(j, 24) for j in (jpegs[0:3], [jpegs[3], jpegs[0], jpegs[0]], jpegs[6:9], [jpegs[0]])]
    expected = [PipelineRunner(runner.spec).run(job) for job in clean]
    assert all(np.array_equal(g, e) for g, e in zip(got, expected, strict=True))
    assert failures == ([(1, 2), (0,)] if cpu_decoder == "libjpeg-turbo" else [(1,), (2,), (0,)])


def test_run_alone_is_refused_with_runs_in_flight(jpegs, cpu_decoder):
    runner = _runner(cpu_decoder, 4, prefetch=2)
    outcomes = runner.run_many(header_job(jpegs[i:i + 2], 16) for i in range(4))
    next(outcomes)
    with pytest.raises(ConfigError, match="in flight"):
        runner.run_alone(header_job(jpegs[:1], 16))


def test_bad_specs_are_config_errors(jpegs, cpu_decoder):
    with pytest.raises(ConfigError, match="device"):
        PipelineSpec(cpu_decoder=cpu_decoder, device="tpu")
    with pytest.raises(ConfigError, match="cpu_decoder"):
        PipelineRunner(PipelineSpec(cpu_decoder="pillow"))
    with pytest.raises(ConfigError, match="batch"):
        _runner(cpu_decoder, 2).run(header_job(jpegs[:3], 32))


def test_a_slot_is_filled_and_handed_back(jpegs):
    runner = PipelineRunner(PipelineSpec(max_batch_size=8, threads=1))
    expected = runner.run(header_job(jpegs[:4], 32))
    given: list[Slot] = []

    def allocate(shape: tuple[int, ...]) -> Slot:
        given.append(Slot(pixels=np.empty(shape, dtype=np.uint8)))
        return given[-1]

    (out,) = runner.run_many([header_job(jpegs[:4], 32)], allocate=allocate)
    assert isinstance(out, Decoded) and out.slot is given[0] and np.array_equal(out.slot.array, expected)
    assert runner.device_copies == runner.host_copies == 0  # the CPU path counts no GPU copies


def test_each_slot_is_sealed_once_written_before_the_next_is_lent(jpegs):
    # A device slot's ready event (what the client's stream waits on) must cover its own
    # writes only: sealed where the message is made, it covered the runs enqueued since.

    said: list[str] = []

    class Ready:  # stands in for the slot's CUDA event
        def __init__(self, n: int) -> None:
            self.n = n

        def record(self, stream: object) -> None:
            said.append(f"sealed {self.n} on {stream}")

    def allocate(shape: tuple[int, ...]) -> Slot:
        n = sum(line.startswith("lent") for line in said)
        said.append(f"lent {n}")
        return Slot(pixels=np.empty(shape, dtype=np.uint8), stream="ring", ready=Ready(n))  # type: ignore[arg-type]

    runner = PipelineRunner(PipelineSpec(max_batch_size=8, threads=1, prefetch=2))
    outs = list(runner.run_many([header_job(jpegs[:4], 32) for _ in range(3)], allocate=allocate))

    assert all(isinstance(out, Decoded) and out.slot.sealed for out in outs)
    assert said == ["lent 0", "sealed 0 on ring", "lent 1", "sealed 1 on ring", "lent 2", "sealed 2 on ring"]


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(AugmentKind))
def test_gpu_pipeline_matches_shapes(kind, jpegs):
    runner = PipelineRunner(PipelineSpec(device="gpu", max_batch_size=8, threads=2))
    out = runner.run(header_job(jpegs[:6], 64, kind))
    assert out.shape == (6, 64, 64, 3) and out.dtype == np.uint8


@pytest.mark.gpu
def test_gpu_output_goes_device_to_device_into_a_cuda_slot(jpegs):
    import torch

    index = torch.cuda.device_count() - 1  # not always device 0
    runner = PipelineRunner(PipelineSpec(device="gpu", device_id=index, max_batch_size=8))
    expected = runner.run(header_job(jpegs[:6], 64))  # through host memory
    assert runner.host_copies == 1
    (out,) = runner.run_many([header_job(jpegs[:6], 64)], allocate=lambda shape: Slot(pixels=torch.empty(
        shape, dtype=torch.uint8, device=f"cuda:{index}")))
    assert isinstance(out, Decoded) and out.slot.tensor.device == torch.device("cuda", index)
    assert runner.device_copies == 1 and runner.host_copies == 1
    # .cpu() is ordered after the copy (same stream). Equal pixels up to decoder rounding
    # (nvJPEG may split a batch between its hardware and CUDA decoders); garbage is ~80.
    assert np.abs(out.slot.tensor.cpu().numpy().astype(np.int16) - expected).mean() < 0.5
