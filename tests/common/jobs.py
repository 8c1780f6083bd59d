"""Jobs for runner tests: encoded samples with windows drawn from their own headers
(the daemon draws them from the index instead)."""

from __future__ import annotations

import io
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from decode.augment import centre_crops, key_hashes, random_resized_crops
from decode.dali import feed
from decode.jobs import Job
from protocol.request import AugmentKind, CropRange


def jpeg_bytes(width: int, height: int, seed: int, quality: int = 75) -> np.ndarray:
    """A JPEG of random pixels."""
    pixels = np.random.default_rng(seed).integers(0, 255, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=quality)
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


def _sizes(jpegs: Sequence[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    sizes = []
    for data in jpegs:
        try:
            with Image.open(io.BytesIO(data.tobytes())) as image:
                sizes.append(image.size)
        except Exception:  # noqa: BLE001 - bytes that are not an image: any window will fail
            sizes.append((8, 8))
    array = np.array(sizes, dtype=np.int64).reshape(-1, 2)
    return array[:, 0], array[:, 1]


def header_job(jpegs: Sequence[np.ndarray], image_size: int, kind: AugmentKind = AugmentKind.VAL,
               seed: int = 0) -> Job:
    """A job whose windows are drawn from each JPEG's own size: the centre crop (val),
    or a random crop keyed by the sample's position (train)."""
    widths, heights = _sizes(jpegs)
    if kind is AugmentKind.VAL:
        crops = centre_crops(widths, heights)
    else:
        keys = [str(i) for i in range(len(jpegs))]
        crops = random_resized_crops(seed, 0, key_hashes(keys), widths, heights, CropRange())
    return Job(list(jpegs), image_size, crops)


def run_pipe(pipe: Any, job: Job, finishing: bool, photometric: bool = False) -> list[np.ndarray]:
    """One run of a built pipeline of :mod:`decode.pipeline` on ``job``: its images
    (the windows, or the finished batch's samples where ``finishing``)."""
    feed(pipe, job, finishing, photometric)
    (out,) = pipe.run()
    return [np.asarray(out[i]) for i in range(len(out))]
