"""Pipelines on synthetic JPEGs: shapes, dtype, per-run sizes, bad bytes; the CPU path
with each of its decoders."""

from __future__ import annotations

import io

import numpy as np
import pytest
from PIL import Image

from core.errors import ConfigError, DataError
from shards import jpeg
from feeder.augment import key_hashes, random_resized_crops
from feeder.pipeline import AugmentKind, CropRange, Crops, Job, PipelineRunner, PipelineSpec, SampleDecodeError


def _jpeg(width: int, height: int, seed: int) -> np.ndarray:
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG")
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


@pytest.fixture(params=["libjpeg-turbo", "dali"])
def cpu_decoder(request: pytest.FixtureRequest) -> str:
    """The CPU path runs with either decoder (libjpeg-turbo where it was built)."""
    if request.param == "libjpeg-turbo" and not jpeg.available():
        pytest.skip(str(jpeg.unavailable_reason()))
    return request.param


@pytest.fixture(scope="module")
def jpegs() -> list[np.ndarray]:
    return [_jpeg(60 + 13 * i, 90 - 5 * i, i) for i in range(9)]


@pytest.mark.parametrize("kind", list(AugmentKind))
def test_batch_and_image_size_change_per_run(kind, jpegs, cpu_decoder):
    runner = PipelineRunner(PipelineSpec(kind, cpu_decoder=cpu_decoder, max_batch_size=8, threads=1))
    first = runner.run(jpegs[:3], 32)
    assert first.shape == (3, 32, 32, 3) and first.dtype == np.uint8
    outs = list(runner.run_many([(jpegs[:8], 48), (jpegs[5:6], 16), (jpegs[1:6], 224)]))
    assert [o.shape for o in outs] == [(8, 48, 48, 3), (1, 16, 16, 3), (5, 224, 224, 3)]


def test_val_is_a_centre_crop_of_the_resized_image(cpu_decoder):
    # Left half black, right half white: the centre crop keeps both, symmetric.
    pixels = np.zeros((80, 160, 3), dtype=np.uint8)
    pixels[:, 80:] = 255
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, max_batch_size=2, threads=1))
    (image,) = runner.run([np.frombuffer(out.getvalue(), np.uint8)], 64)
    assert image[:, :20].mean() < 20 and image[:, -20:].mean() > 235


def test_train_is_deterministic_for_a_seed(jpegs, cpu_decoder):
    spec = PipelineSpec(AugmentKind.TRAIN, cpu_decoder=cpu_decoder, max_batch_size=4, threads=1)
    a = PipelineRunner(spec, seed=7).run(jpegs[:4], 40)
    b = PipelineRunner(spec, seed=7).run(jpegs[:4], 40)
    assert np.array_equal(a, b)


def test_train_mirrors_about_half_the_images(cpu_decoder):
    # Left half white, right half black; a full-image crop keeps that or mirrors it.
    pixels = np.zeros((64, 64, 3), dtype=np.uint8)
    pixels[:, :32] = 255
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    jpeg = np.frombuffer(out.getvalue(), dtype=np.uint8)
    whole = CropRange(min_scale=1.0, max_scale=1.0, min_ratio=1.0, max_ratio=1.0)
    side = np.full(64, 64)
    crops = random_resized_crops(3, 0, key_hashes([str(i) for i in range(64)]), side, side, whole)
    runner = PipelineRunner(PipelineSpec(AugmentKind.TRAIN, cpu_decoder=cpu_decoder, max_batch_size=64, threads=1))
    images = runner.run([jpeg] * 64, 32, crops).astype(np.int32)
    left, right = images[:, :, :16].mean(axis=(1, 2, 3)), images[:, :, 16:].mean(axis=(1, 2, 3))
    assert np.all(np.abs(left - right) > 200)  # each image is the original or its mirror
    mirrored = int((left < right).sum())
    assert 12 <= mirrored <= 52  # coin flip with p = 0.5 over 64 samples
    assert np.array_equal(left < right, crops.flips)


def test_windows_are_decoded_where_the_crops_say(jpegs, cpu_decoder):
    # A 4x4 grid of flat colours: a window on one cell gives that colour only.
    pixels = np.zeros((128, 128, 3), dtype=np.uint8)
    for row in range(4):
        for col in range(4):
            pixels[32 * row:32 * (row + 1), 32 * col:32 * (col + 1)] = (60 * row, 60 * col, 128)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=98)
    jpeg = np.frombuffer(out.getvalue(), np.uint8)
    boxes = np.array([[36, 4, 24, 24], [68, 100, 24, 24]], dtype=np.int32)
    crops = Crops(boxes=boxes, flips=np.array([False, True]))
    for antialias in (False, True):
        spec = PipelineSpec(AugmentKind.TRAIN, cpu_decoder=cpu_decoder, max_batch_size=2, threads=1,
                            antialias=antialias)
        runner = PipelineRunner(spec)
        images = runner.run([jpeg, jpeg], 16, crops).reshape(2, -1, 3).astype(int)
        assert np.abs(images[0] - (0, 60, 128)).max() <= 4
        assert np.abs(images[1] - (180, 120, 128)).max() <= 4


def test_crops_must_match_the_batch(jpegs, cpu_decoder):
    runner = PipelineRunner(PipelineSpec(AugmentKind.TRAIN, cpu_decoder=cpu_decoder, max_batch_size=4, threads=1))
    crops = Crops(boxes=np.array([[0, 0, 8, 8]], np.int32), flips=np.zeros(1, bool))
    with pytest.raises(ConfigError, match="crops"):
        list(runner.run_many([Job(jpegs[:2], 16, crops)]))


def test_undecodable_bytes_raise_data_error(jpegs, cpu_decoder):
    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, max_batch_size=4, threads=1))
    with pytest.raises(DataError, match="decode failed"):
        runner.run([jpegs[0], np.frombuffer(b"not a jpeg" * 10, np.uint8)], 32)


def _unreadable_scan(jpeg: np.ndarray) -> np.ndarray:
    data = bytearray(jpeg.tobytes())
    data[data.index(b"\xff\xda") + 6] = 0x33  # the scan asks for Huffman tables the file lacks
    return np.frombuffer(bytes(data), np.uint8)


def test_a_failed_run_names_its_sample_and_the_runner_goes_on(jpegs, cpu_decoder):
    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, max_batch_size=4, threads=1))
    with pytest.raises(SampleDecodeError) as caught:
        runner.run([jpegs[0], _unreadable_scan(jpegs[1]), jpegs[2]], 32)
    assert caught.value.positions == (1,)
    assert runner.run(jpegs[:3], 32).shape == (3, 32, 32, 3)


def test_repaired_runs_come_out_in_order_with_runs_in_flight(jpegs, cpu_decoder):
    spec = PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, max_batch_size=4, threads=1, prefetch=2)
    bad = _unreadable_scan(jpegs[5])
    jobs = [Job(jpegs[0:3], 24), Job([jpegs[3], bad, bad], 24), Job(jpegs[6:9], 24), Job([bad], 24)]
    repairs = []

    def repair(job, error):  # replace every failing sample by the first image
        repairs.append(error.positions)
        return Job([jpegs[0] if i in error.positions else j for i, j in enumerate(job.jpegs)], 24)

    got = list(PipelineRunner(spec).run_many(jobs, repair))
    clean = [Job(jpegs[0:3], 24), Job([jpegs[3], jpegs[0], jpegs[0]], 24), Job(jpegs[6:9], 24), Job([jpegs[0]], 24)]
    expected = list(PipelineRunner(spec).run_many(clean))
    assert [g.shape for g in got] == [e.shape for e in expected]
    assert all(np.array_equal(g, e) for g, e in zip(got, expected))
    # libjpeg-turbo names every failing sample of a run; DALI one per run.
    assert repairs == ([(1, 2), (0,)] if cpu_decoder == "libjpeg-turbo" else [(1,), (2,), (0,)])


def test_bad_specs_are_config_errors(jpegs, cpu_decoder):
    with pytest.raises(ConfigError, match="device"):
        PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, device="tpu")
    with pytest.raises(ConfigError, match="cpu_decoder"):
        PipelineSpec(AugmentKind.VAL, cpu_decoder="pillow")
    with pytest.raises(ConfigError, match="min_scale"):
        CropRange(min_scale=0.5, max_scale=0.2)
    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, cpu_decoder=cpu_decoder, max_batch_size=2, threads=1))
    with pytest.raises(ConfigError, match="batch"):
        runner.run(jpegs[:3], 32)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", list(AugmentKind))
def test_gpu_pipeline_matches_shapes(kind, jpegs):
    runner = PipelineRunner(PipelineSpec(kind, device="gpu", max_batch_size=8, threads=2))
    out = runner.run(jpegs[:6], 64)
    assert out.shape == (6, 64, 64, 3) and out.dtype == np.uint8


def test_a_torch_destination_is_filled_and_returned(jpegs):
    import torch

    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, max_batch_size=8, threads=1))
    expected = runner.run(jpegs[:4], 32)
    given: list[torch.Tensor] = []

    def allocate(shape: tuple[int, ...]) -> torch.Tensor:
        given.append(torch.empty(shape, dtype=torch.uint8))
        return given[-1]

    (out,) = runner.run_many([Job(jpegs[:4], 32)], allocate=allocate)
    assert out is given[0] and np.array_equal(out.numpy(), expected)
    assert runner.device_copies == runner.host_copies == 0  # the CPU path counts no GPU copies


@pytest.mark.gpu
def test_gpu_output_goes_device_to_device_into_a_cuda_destination(jpegs):
    import torch

    index = torch.cuda.device_count() - 1  # not always device 0
    runner = PipelineRunner(PipelineSpec(AugmentKind.VAL, device="gpu", device_id=index, max_batch_size=8))
    expected = runner.run(jpegs[:6], 64)  # through host memory
    assert runner.host_copies == 1
    (out,) = runner.run_many([Job(jpegs[:6], 64)], allocate=lambda shape: torch.empty(
        shape, dtype=torch.uint8, device=f"cuda:{index}"))
    assert out.device == torch.device("cuda", index) and runner.device_copies == 1 and runner.host_copies == 1
    # .cpu() is ordered after the copy (same stream). Equal pixels up to decoder rounding
    # (nvJPEG may split a batch between its hardware and CUDA decoders); garbage is ~80.
    assert np.abs(out.cpu().numpy().astype(np.int16) - expected).mean() < 0.5
