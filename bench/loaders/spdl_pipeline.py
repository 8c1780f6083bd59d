"""``spdl``: SPDL's thread pipeline decoding, cropping and scaling with FFmpeg, in a venv of its own.

SPDL 0.8 (``spdl-io``, ``spdl-core``) loads the system's FFmpeg shared libraries (any of
FFmpeg 4 to 9) at run time; it runs in ``CACHE/venv-spdl`` (``bench/venvs.py``: the
Debian package ``ffmpeg`` brings the libraries, then the pinned requirements).

What runs, and why (SPDL's docs and examples, github.com/facebookresearch/spdl:
``docs/source/best_practice.rst``, ``docs/source/io/filtering.rst``,
``examples/multi_thread_preprocessing.py``, ``src/spdl/io/_composite.py``):

- **Data**: the same JPEG bytes as the other loaders, read from the tars into memory
  (the first ``_MAX_SAMPLES`` of the split, the ``tfdata`` loader's cap), in a fresh
  shuffle every epoch, endlessly.
- **Per image**, on the pipeline's thread pool: ``spdl.io.demux_image(bytes)``, a
  RandomResizedCrop window drawn with torchvision's law from the packets' width and
  height (``crop_window``), then ``spdl.io.decode_packets(packets, filter_desc=...)``
  with the FFmpeg filter graph ``crop=w:h:x:y,scale=S:S:flags=bilinear[,hflip],
  format=rgb24`` (``filter_desc``): the filtering guide's way to augment while
  decoding ("Applying filters to decoded frames before buffer conversion"; the crop
  acts on the decoded YUV planes, and swscale scales and converts to RGB in one pass).
  Bilinear, the filter of feeder and of the ``tfdata`` loader (SPDL's default is
  bicubic). FFmpeg decodes each image on one thread (SPDL's default), the pipeline
  decoding ``threads`` images at once.
- **Batches**: the best-practice pipeline, decode frames per image and make the batch
  array once with ``spdl.io.convert_frames`` (no tensor per image):
  ``PipelineBuilder().add_source(...).pipe(decode, concurrency=threads)
  .aggregate(batch_size, drop_last=True).pipe(batchify).add_sink(threads)
  .build(num_threads=threads)``, the shape of SPDL's multi-thread preprocessing
  example. The consumer gets uint8 NHWC numpy arrays (and the labels).
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.loaders.base import Batch, LoaderSpec, LoaderUnavailable
from bench.loaders.tar_samples import Sample, read_samples
from bench.venvs import Environment

__all__ = ["ENVIRONMENT", "crop_window", "filter_desc", "open_loader", "sample_order"]

ENVIRONMENT = Environment(
    name="spdl",
    requirements=("spdl==0.8.0", "spdl-io==0.8.0", "spdl-core==0.8.0", "numpy==2.4.6"),
    # spdl.io loads FFmpeg on first use: the attribute, not the import, proves it is there.
    check="import spdl.io, spdl.pipeline; spdl.io.demux_image",
    debian_packages=("ffmpeg",),
)

# Encoded samples held in memory (the tfdata loader's cap).
_MAX_SAMPLES = 20000
_TRIES = 10
_SCALE = (0.08, 1.0)
_RATIO = (3 / 4, 4 / 3)


def crop_window(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """``(x, y, w, h)`` of a RandomResizedCrop window of a ``width`` x ``height`` image:
    torchvision's law (area uniform in [0.08, 1] of the image's, aspect ratio
    log-uniform in [3/4, 4/3], 10 tries, then the central crop clamped to the ratios).

    Raises:
        ValueError: the image has no pixels.
    """
    if width < 1 or height < 1:
        raise ValueError(f"an image of {width}x{height} has no window")
    area = width * height
    low, high = math.log(_RATIO[0]), math.log(_RATIO[1])
    for _ in range(_TRIES):
        target = area * rng.uniform(*_SCALE)
        aspect = math.exp(rng.uniform(low, high))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    ratio = width / height
    if ratio < _RATIO[0]:
        w, h = width, round(width / _RATIO[0])
    elif ratio > _RATIO[1]:
        w, h = round(height * _RATIO[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def filter_desc(window: tuple[int, int, int, int], flip: bool, side_px: int) -> str:
    """The FFmpeg filter graph that crops ``window``, scales it to ``side_px`` square
    (bilinear), flips it if ``flip`` and converts it to packed RGB."""
    x, y, w, h = window
    flipped = "hflip," if flip else ""
    return f"crop=w={w}:h={h}:x={x}:y={y},scale=w={side_px}:h={side_px}:flags=bilinear,{flipped}format=pix_fmts=rgb24"


def sample_order(count: int, seed: int) -> Iterator[int]:
    """Endless sample indices: every epoch a fresh permutation of ``0 .. count-1``."""
    rng = random.Random(seed)
    order = list(range(count))
    while True:
        rng.shuffle(order)
        yield from order


def _import_spdl() -> Any:
    try:
        import spdl.io
        import spdl.pipeline

        spdl.io.demux_image  # noqa: B018  # loads FFmpeg's libraries, or says which are missing
    except (ImportError, RuntimeError) as e:  # outside CACHE/venv-spdl, or no FFmpeg
        reason = str(e).splitlines()[0][:300] if str(e) else type(e).__name__
        raise LoaderUnavailable(f"spdl cannot be used here ({reason}); the bench runs it in its own venv") from e
    return spdl


def _pipeline(spdl: Any, samples: list[Sample], spec: LoaderSpec) -> Any:
    rng = random.Random(spec.seed + 1)  # draws of the windows and flips, apart from the order's

    def decode(index: int) -> tuple[Any, int]:
        sample = samples[index]
        packets = spdl.io.demux_image(sample.jpeg)
        window = crop_window(packets.width, packets.height, rng)
        graph = filter_desc(window, rng.random() < 0.5, spec.image_size_px)
        return spdl.io.decode_packets(packets, filter_desc=graph), sample.label

    def batchify(items: list[tuple[Any, int]]) -> tuple[Any, list[int]]:
        frames, labels = zip(*items)
        return spdl.io.to_numpy(spdl.io.convert_frames(list(frames))), list(labels)

    return (
        spdl.pipeline.PipelineBuilder()
        .add_source(sample_order(len(samples), spec.seed))
        .pipe(decode, concurrency=spec.threads)
        .aggregate(spec.batch_size, drop_last=True)
        .pipe(batchify)
        .add_sink(spec.threads)
        .build(num_threads=spec.threads)
    )


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches from SPDL's pipeline.

    Raises:
        LoaderUnavailable: spdl (or FFmpeg) cannot be loaded in this interpreter.
        FileNotFoundError, ValueError: the shards or the split are not there.
    """
    spdl = _import_spdl()
    samples = read_samples(spec.shards, spec.split, _MAX_SAMPLES)
    pipeline = _pipeline(spdl, samples, spec)
    with pipeline.auto_stop():
        yield (Batch(int(images.shape[0]), images, "NHWC", "uint8") for images, _ in pipeline)
