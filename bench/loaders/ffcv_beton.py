"""``ffcv``: FFCV's ``Loader`` over a ``.beton`` written from the same JPEGs, in a venv of its own.

FFCV 1.0.2 (the last release) builds its C extension against the system's libturbojpeg
and OpenCV, and JIT-compiles its pipeline with numba; it runs in ``CACHE/venv-ffcv``
(``bench/venvs.py``: the Debian packages of ``ENVIRONMENT``, then the pinned
requirements, the versions it was checked with here).

What runs, and why (FFCV's docs and source, github.com/libffcv/ffcv: the tuning guide
``docs/parameter_tuning.rst``, ``docs/working_with_images.rst``,
``docs/bottleneck_doctor.rst``, ``ffcv/loader/loader.py``, ``ffcv/fields/rgb_image.py``,
and the train pipeline of its ImageNet example, libffcv/imagenet-example):

- **The dataset file**, written once by ``prepare`` (before the loader's process starts,
  so neither its time nor its memory is charged to the loader): the first
  ``_MAX_SAMPLES`` samples of the split (the ``tfdata`` loader's cap; the stored JPEG
  bytes, read from the tars), decoded with Pillow and written by
  ``DatasetWriter(num_workers=threads)`` with ``RGBImageField(write_mode="jpg",
  max_resolution=512, jpeg_quality=90)`` (every image stored as a JPEG that FFCV
  re-encodes at quality 90, sides over 512 px scaled down: the ImageNet example's
  setting) and an ``IntField`` label. It is kept under ``CACHE/ffcv/``, named by a
  digest of the shards' manifest, the split and these options.
- **The loader**: ``Loader(batch_size, num_workers=threads, order=OrderOption.RANDOM,
  os_cache=True, drop_last=True)``: the tuning guide's choice for a dataset that fits in
  memory ("use os_cache=True", RANDOM or QUASI_RANDOM "should both perform very
  similarly"; QUASI_RANDOM pays when the file does not fit and is read from disk).
  ``num_workers`` is FFCV's thread count (its numba ``prange`` over the batch), the
  budget; ``batches_ahead`` is the default, 3.
- **The pipeline**: ``RandomResizedCropRGBImageDecoder((S, S))`` (scale 0.08-1, ratio
  3/4-4/3, torchvision's law; the whole image decoded by libjpeg-turbo with
  ``TJFLAG_FASTDCT``, the window resized with OpenCV's ``INTER_AREA``),
  ``RandomHorizontalFlip()``, ``ToTensor()``: uint8 NHWC torch tensors in the consumer's
  process. Labels: ``IntDecoder()``, ``ToTensor()``, ``Squeeze()``. The example's
  ``ToDevice``, ``ToTorchImage`` and ``NormalizeImage`` are its GPU end, left out as
  every loader here hands uint8 pixels to the CPU.
- **Epochs**: FFCV's loader ends at each epoch and starts a new epoch thread (its
  prefetch refilled) for the next; the sample data's epoch is 15 batches, so each of the
  loader's epochs walks the samples repeated (``indices``) to at least
  ``_MIN_EPOCH_BATCHES`` batches: the restart comes no more often than on a real dataset.
"""

from __future__ import annotations

import hashlib
import io
import json
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.loaders.base import Batch, LoaderSpec, LoaderUnavailable
from bench.loaders.tar_samples import Sample, manifest_digest, read_samples
from bench.venvs import Environment

__all__ = ["ENVIRONMENT", "DecodedSamples", "beton_path", "epoch_indices", "open_loader", "prepare"]

ENVIRONMENT = Environment(
    name="ffcv",
    requirements=(
        "ffcv==1.0.2", "numpy==2.4.6", "numba==0.68.1", "opencv-python==5.0.0.93", "pillow==13.0.0", "torch==2.14.1",
    ),
    check="import ffcv.fields.decoders, ffcv.loader, ffcv.transforms, ffcv.writer",
    # The C extension's build: a compiler, pkg-config, libturbojpeg's and OpenCV's headers.
    debian_packages=("g++", "pkg-config", "libturbojpeg0-dev", "libopencv-dev"),
)

# Encoded samples written to the dataset file (the tfdata loader's cap).
_MAX_SAMPLES = 20000
_FIELD = {"write_mode": "jpg", "max_resolution": 512, "jpeg_quality": 90}
# Fewest batches in one of the loader's epochs (see the module docstring).
_MIN_EPOCH_BATCHES = 100


def _import_ffcv() -> Any:
    try:
        import ffcv.fields
        import ffcv.fields.decoders
        import ffcv.loader
        import ffcv.reader
        import ffcv.transforms
        import ffcv.writer
    except ImportError as e:  # the worker was started outside CACHE/venv-ffcv
        raise LoaderUnavailable(f"ffcv cannot be imported here ({e}); the bench runs it in its own venv") from e
    return ffcv


def beton_path(spec: LoaderSpec) -> Path:
    """Where the dataset file for ``spec``'s shards and split is kept.

    Raises:
        FileNotFoundError: ``spec.shards`` has no manifest.
    """
    key = {"manifest_sha256": manifest_digest(spec.shards), "split": spec.split, "max_samples": _MAX_SAMPLES,
           "field": _FIELD}
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:20]
    root = spec.cache if spec.cache is not None else Path(tempfile.gettempdir()) / "feeder-bench"
    return root / "ffcv" / f"{spec.split}-{digest}.beton"


class DecodedSamples:
    """The samples as ``DatasetWriter.from_indexed_dataset`` reads them: ``(RGB image, label)``."""

    def __init__(self, samples: list[Sample]) -> None:
        self._samples = samples

    def __len__(self) -> int:
        return len(self._samples)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        from PIL import Image

        sample = self._samples[index]
        return Image.open(io.BytesIO(sample.jpeg)).convert("RGB"), sample.label


def prepare(spec: LoaderSpec) -> None:
    """Writes the dataset file of ``spec`` unless it is there (``bench/worker.py --prepare``).

    Raises:
        LoaderUnavailable: ffcv cannot be imported.
        FileNotFoundError, ValueError: the shards or the split are not there.
    """
    path = beton_path(spec)
    if path.is_file():
        return
    ffcv = _import_ffcv()
    samples = read_samples(spec.shards, spec.split, _MAX_SAMPLES)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    fields = {"image": ffcv.fields.RGBImageField(**_FIELD), "label": ffcv.fields.IntField()}
    ffcv.writer.DatasetWriter(str(partial), fields, num_workers=spec.threads).from_indexed_dataset(
        DecodedSamples(samples)
    )
    partial.rename(path)  # a file that is there is whole


def epoch_indices(count: int, batch_size: int) -> list[int]:
    """The samples one epoch of the loader walks (in RANDOM order): ``0 .. count-1``,
    repeated until the epoch holds at least ``_MIN_EPOCH_BATCHES`` batches."""
    if count < 1 or batch_size < 1:
        raise ValueError(f"count and batch_size must be positive, got {count} and {batch_size}")
    total = max(count, _MIN_EPOCH_BATCHES * batch_size)
    repeats = -(-total // count)
    return [i for _ in range(repeats) for i in range(count)]


def _loader(ffcv: Any, path: Path, spec: LoaderSpec) -> Any:
    decoders, transforms = ffcv.fields.decoders, ffcv.transforms
    count = int(ffcv.reader.Reader(str(path)).num_samples)  # a numpy uint64
    pipelines = {
        "image": [decoders.RandomResizedCropRGBImageDecoder((spec.image_size_px, spec.image_size_px)),
                  transforms.RandomHorizontalFlip(), transforms.ToTensor()],
        "label": [decoders.IntDecoder(), transforms.ToTensor(), transforms.Squeeze()],
    }
    return ffcv.loader.Loader(
        str(path), batch_size=spec.batch_size, num_workers=spec.threads, os_cache=True,
        order=ffcv.loader.OrderOption.RANDOM, seed=spec.seed, indices=epoch_indices(count, spec.batch_size),
        pipelines=pipelines, drop_last=True,
    )


def _endless(loader: Any) -> Iterator[Batch]:
    while True:
        for images, _ in loader:
            yield Batch(int(images.shape[0]), images, "NHWC", "uint8")


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches from FFCV's loader (writing the dataset file
    first if ``prepare`` has not).

    Raises:
        LoaderUnavailable: ffcv cannot be imported in this interpreter.
        FileNotFoundError, ValueError: the shards or the split are not there.
    """
    ffcv = _import_ffcv()
    prepare(spec)
    yield _endless(_loader(ffcv, beton_path(spec), spec))
