"""The photometric steps: drawn per training sample from (seed, epoch, key) in their
ranges (:class:`decode.augment.Jitter`), applied by the finishing stage
(:mod:`decode.finish`) on the CPU and in the GPU's DALI graph (built here on DALI's
CPU backend, ``device_id=None``). Off, the default, nothing is drawn and no pixel
changes; on, the graph and the CPU stage tone the same pixels the same, and after
their resizes they differ only where those did."""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from core.errors import ConfigError
from decode.augment import Crops, Jitter, Tone, key_hashes, sample_crops, sample_tone
from decode.dali_graphs import crop_decode_pipeline, gpu_pipeline
from decode.finish import Finisher, tone_table
from decode.jobs import Job
from feeder.config import ServerConfig
from protocol.request import AugmentKind, CropRange
from tests.common.jobs import header_job, jpeg_bytes, run_pipe

ALL_ON = Jitter(**{f.name: 0.4 for f in fields(Jitter)})
KEYS = [f"n0144{i:04d}_{i * 7}" for i in range(300)]
SIZES = np.random.default_rng(0).integers(40, 600, (2, len(KEYS)))
_BATCH = 6


def _drawn(jitter: Jitter, keys: list[str] = KEYS, epoch: int = 0, kind: AugmentKind = AugmentKind.TRAIN,
           rows: np.ndarray | slice = slice(None)) -> Crops:
    return sample_crops(kind, 1, epoch, keys, SIZES[0][rows], SIZES[1][rows], CropRange(), jitter)


def test_off_by_default_nothing_is_drawn_and_turned_on_no_crop_or_flip_changes():
    assert Jitter() == Jitter(**{f.name: 0.0 for f in fields(Jitter)}) and not Jitter().on
    off, on = _drawn(Jitter()), _drawn(ALL_ON)
    assert off.tone is None and on.tone is not None
    assert np.array_equal(off.boxes, on.boxes) and np.array_equal(off.flips, on.flips)
    assert _drawn(ALL_ON, kind=AugmentKind.VAL).tone is None  # validation is never jittered


@pytest.mark.parametrize("step", [f.name for f in fields(Tone)])
def test_each_factor_is_drawn_in_its_range_from_seed_epoch_and_key(step):
    tone = _drawn(ALL_ON).tone
    assert tone is not None
    factors = getattr(tone, step)
    assert factors.dtype == np.float32 and 0.6 <= factors.min() and factors.max() <= 1.4
    assert np.histogram(factors, bins=4, range=(0.6, 1.4))[0].min() > len(KEYS) / 8  # spread over the range
    order = np.random.default_rng(2).permutation(len(KEYS))
    part = _drawn(ALL_ON, [KEYS[i] for i in order], rows=order).tone
    assert part is not None and np.array_equal(getattr(part, step), factors[order])  # whatever batch it is in
    other_epoch = _drawn(ALL_ON, epoch=1).tone
    assert other_epoch is not None and np.mean(getattr(other_epoch, step) != factors) > 0.99


def test_a_step_left_off_beside_one_turned_on_draws_factors_of_one():
    for on in fields(Jitter):
        jitter = Jitter(**{on.name: 0.5})
        tone = sample_tone(1, 0, key_hashes(KEYS), jitter)
        assert tone is not None and jitter.pixel_options() == {on.name: "0.5"}
        ones = [f.name for f in fields(Tone) if np.all(getattr(tone, f.name) == 1.0)]
        assert len(ones) == len(fields(Tone)) - 1


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf])
def test_a_spread_that_is_not_a_number_from_zero_up_is_refused_naming_the_option(value, tmp_path: Path):
    for f in fields(Jitter):
        with pytest.raises(ConfigError, match=f"^{f.name}: must be a number >= 0"):
            Jitter(**{f.name: value})
        with pytest.raises(ConfigError, match=f"^{f.name}: "):
            ServerConfig.of(datasets={"d": tmp_path}, **{f.name: value})


def test_the_steps_are_pixel_options_only_while_on(tmp_path: Path):
    plain = ServerConfig.of(datasets={"d": tmp_path})
    jittered = ServerConfig.of(datasets={"d": tmp_path}, **{f.name: 0.4 for f in fields(Jitter)})
    assert set(jittered.pixel_options) - set(plain.pixel_options) == {f.name for f in fields(Jitter)}
    assert ServerConfig.of(datasets={"d": tmp_path}, **{f.name: 0.0 for f in fields(Jitter)}).pixel_options == \
        plain.pixel_options


def _reference(tone: Tone, row: int, values: np.ndarray) -> np.ndarray:
    """The steps in float64, rounded to the nearest level."""
    brightness, contrast = float(tone.brightness[row]), float(tone.contrast[row])
    return np.clip(np.rint(brightness * (128 + contrast * (values.astype(np.float64) - 128))), 0, 255)


def test_the_cpu_table_is_the_steps_formula():
    tone = sample_tone(4, 2, key_hashes(KEYS[:50]), ALL_ON)
    assert tone is not None
    levels = np.arange(256)
    for row in range(50):
        assert np.abs(tone_table(tone, row).astype(int) - _reference(tone, row, levels)).max() <= 1


def _pipes(photometric: bool) -> tuple[Any, Any]:
    common = dict(batch_size=_BATCH, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    decode_only = crop_decode_pipeline(**common)
    graph = gpu_pipeline(antialias=False, decode_on="cpu", photometric=photometric, **common)
    decode_only.build()
    graph.build()
    return decode_only, graph


def _run(pipe: Any, job: Job, finishing: bool, photometric: bool = False) -> np.ndarray | list[np.ndarray]:
    images = run_pipe(pipe, job, finishing, photometric)
    return np.stack(images) if finishing else images


def _job(image_size: int, jitter: Jitter, windows_at_output_size: bool = False) -> Job:
    sizes = [(320, 240), (200, 300), (96, 96), (500, 180), (64, 80), (256, 256)]
    job = header_job([jpeg_bytes(w, h, seed=k, quality=90) for k, (w, h) in enumerate(sizes)], image_size,
                     AugmentKind.TRAIN, seed=0)
    boxes = job.crops.boxes.copy()
    if windows_at_output_size:  # each image's top left corner, no resize: the steps alone
        boxes[:, :2], boxes[:, 2:] = 0, image_size
    tone = sample_tone(0, 0, key_hashes([str(i) for i in range(len(sizes))]), jitter)
    return Job(job.jpegs, image_size, Crops(boxes, job.crops.flips, tone))


def test_on_the_same_pixels_the_dali_graph_tones_as_the_cpu_stage(lane):
    decode_only, graph = _pipes(photometric=True)
    job = _job(64, ALL_ON, windows_at_output_size=True)
    tone = job.crops.tone
    assert tone is not None and (tone.brightness > 1).any() and (tone.brightness < 1).any()
    windows = _run(decode_only, job, finishing=False)
    on_cpu = Finisher(lane).finish(windows, 64, job.crops)
    in_graph = _run(graph, job, finishing=True, photometric=True)
    assert np.abs(in_graph.astype(int) - on_cpu).max() <= 1
    untoned = Finisher(lane).finish(windows, 64, Crops(job.crops.boxes, job.crops.flips))
    assert np.mean(on_cpu != untoned) > 0.5  # the steps did change the pixels


@pytest.mark.parametrize("image_size", [48, 224])
def test_after_their_resizes_the_graph_and_the_cpu_stage_differ_only_where_the_resizes_did(lane, image_size):
    decode_only, graph = _pipes(photometric=True)
    _, plain_graph = _pipes(photometric=False)
    job = _job(image_size, ALL_ON)
    assert job.crops.tone is not None
    windows = _run(decode_only, job, finishing=False)
    toned = np.abs(_run(graph, job, True, photometric=True).astype(int) - Finisher(lane).finish(windows, image_size,
                                                                                                  job.crops))
    plain = Crops(job.crops.boxes, job.crops.flips)
    untoned = np.abs(_run(plain_graph, Job(job.jpegs, image_size, plain), True).astype(int)
                     - Finisher(lane).finish(windows, image_size, plain))
    assert untoned.max() <= 1
    assert np.all(toned[untoned == 0] == 0)  # the same resized values: the same toned ones
    # A level's difference scaled by a factor above 1 may round to two, never more.
    assert toned.max() <= 2 and np.mean(toned > 1) < 0.005


def test_off_the_graph_and_the_cpu_stage_write_what_they_wrote_without_the_steps(lane):
    decode_only, graph = _pipes(photometric=True)
    _, plain_graph = _pipes(photometric=False)
    job = _job(48, Jitter())
    assert job.crops.tone is None
    assert np.array_equal(_run(graph, job, True, photometric=True), _run(plain_graph, job, True))  # fed factors of 1
    windows = _run(decode_only, job, finishing=False)
    unchanged = Crops(job.crops.boxes, job.crops.flips, Tone.unchanged(len(job)))
    assert np.array_equal(Finisher(lane).finish(windows, 48, unchanged), Finisher(lane).finish(windows, 48, job.crops))


def test_a_job_of_some_rows_carries_their_factors(lane):
    job = _job(32, ALL_ON)
    part = job.only([4, 1])
    assert part.crops.tone is not None and job.crops.tone is not None
    assert np.array_equal(part.crops.tone.brightness, job.crops.tone.brightness[[4, 1]])
