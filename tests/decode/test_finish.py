"""The finishing stage (:mod:`decode.finish`), each of its two ways real: the CPU's
(the C resize on a lane) and the DALI graph a GPU pipeline finishes its batches in,
built here on DALI's CPU backend (``device_id=None``). The same decoded windows come
out of both within one grey level, flips included, whatever the size; on the CPU the
stage writes exactly what the resize alone writes."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from decode.dali_graphs import crop_decode_pipeline, gpu_pipeline
from decode.finish import Finisher
from decode.jobs import Job
from decode.resize import BatchResizer
from protocol.request import AugmentKind
from tests.common.jobs import header_job, jpeg_bytes, run_pipe

_BATCH = 6


def _job(image_size: int, seed: int = 0) -> Job:
    """Random crops and flips (half of them mirrored or not, as drawn) of JPEGs of
    several sizes."""
    sizes = [(320, 240), (200, 300), (96, 96), (500, 180), (64, 80), (256, 256)]
    return header_job([jpeg_bytes(w, h, seed=k, quality=90) for k, (w, h) in enumerate(sizes)], image_size,
                      AugmentKind.TRAIN, seed=seed)


def _built(pipe: Any) -> Any:
    pipe.build()
    return pipe


def _pipes() -> tuple[Any, Any]:
    """DALI's CPU window decode alone, and the GPU pipeline's graph (that decode, then
    the finishing stage) on DALI's CPU backend."""
    common = dict(batch_size=_BATCH, num_threads=1, device_id=None, prefetch_queue_depth=1, exec_dynamic=True)
    return _built(crop_decode_pipeline(**common)), _built(gpu_pipeline(antialias=False, decode_on="cpu", **common))


@pytest.mark.parametrize("image_size", [48, 224])
def test_the_dali_graph_finishes_the_same_windows_as_the_cpu_within_one_grey_level(lane, image_size):
    decode_only, graph = _pipes()
    job = _job(image_size)
    assert job.crops.flips.any() and not job.crops.flips.all()
    windows = run_pipe(decode_only, job, finishing=False)
    on_cpu = Finisher(lane).finish(windows, image_size, job.crops)
    in_graph = np.stack(run_pipe(graph, job, finishing=True))
    assert in_graph.shape == on_cpu.shape == (_BATCH, image_size, image_size, 3)
    assert np.abs(in_graph.astype(int) - on_cpu).max() <= 1
    assert np.mean(in_graph != on_cpu) < 0.05  # rounding, not another filter


def test_on_the_cpu_the_stage_writes_what_the_resize_alone_writes(lane):
    decode_only, _ = _pipes()
    job = _job(64, seed=3)
    windows = run_pipe(decode_only, job, finishing=False)
    resized = BatchResizer(lane).resize(windows, 64, job.crops.flips)
    out = np.zeros_like(resized)
    assert Finisher(lane).finish(windows, 64, job.crops, out=out) is out
    assert np.array_equal(out, resized)


def test_a_finishing_started_ahead_is_written_once_waited_for(lane):
    decode_only, _ = _pipes()
    job = _job(32, seed=5)
    windows = run_pipe(decode_only, job, finishing=False)
    out, finishing = Finisher(lane).start(windows, 32, job.crops)
    finishing.wait()
    assert np.array_equal(out, Finisher(lane).finish(windows, 32, job.crops))


def test_a_job_of_some_rows_carries_their_flips_to_the_stage(lane):
    job = _job(32, seed=7)
    rows = [4, 1]
    part = job.only(rows)
    assert np.array_equal(part.crops.flips, job.crops.flips[rows])
    assert np.array_equal(part.crops.boxes, job.crops.boxes[rows])
