"""DALI decode + augment pipelines fed with encoded JPEG bytes, and a small runner
that executes one of them on a list of samples at a requested batch and image size.

The pipelines are plain ``@pipeline_def`` functions: every input is explicit. The
image size arrives per sample through an ``external_source`` so one built pipeline
serves any size (progressive resizing needs no rebuild); the batch size varies per
run up to the ``batch_size`` the pipeline was built with.

Usable without gRPC: the in-process DALI baseline in ``bench/`` runs the same code.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np
from nvidia.dali import fn, pipeline_def, types

from core.errors import ConfigError, DataError

__all__ = [
    "AugmentKind",
    "CropRange",
    "PipelineRunner",
    "PipelineSpec",
    "train_pipeline",
    "val_pipeline",
]

# Validation resizes the shorter side to image_size / VAL_CROP_FRACTION, then takes
# the centre image_size square (the 224 / 256 convention).
VAL_CROP_FRACTION = 0.875
_JPEGS = "jpegs"
_SIZES = "sizes"


class AugmentKind(str, enum.Enum):
    """Which transform a pipeline applies."""

    TRAIN = "train"
    VAL = "val"


@dataclass(frozen=True)
class CropRange:
    """RandomResizedCrop limits: area fraction and aspect ratio (width / height)."""

    min_scale: float = 0.08
    max_scale: float = 1.0
    min_ratio: float = 3 / 4
    max_ratio: float = 4 / 3

    def __post_init__(self) -> None:
        if not 0 < self.min_scale <= self.max_scale <= 1:
            raise ConfigError(
                f"min_scale/max_scale: need 0 < {self.min_scale} <= {self.max_scale} <= 1"
            )
        if not 0 < self.min_ratio <= self.max_ratio:
            raise ConfigError(f"min_ratio/max_ratio: need 0 < {self.min_ratio} <= {self.max_ratio}")


def _decoder_device(device: str) -> str:
    return "mixed" if device == "gpu" else "cpu"


@pipeline_def
def train_pipeline(device: str, crop: CropRange, decode_seed: int = -1):
    """Decode with a random ROI crop (RandomResizedCrop), resize, random flip.

    Inputs (external_source): ``jpegs`` (uint8 bytes per sample) and ``sizes``
    (float32 ``[image_size]`` per sample). Output: uint8 HWC, RGB.
    """
    jpegs = fn.external_source(name=_JPEGS, dtype=types.DALIDataType.UINT8, ndim=1)
    sizes = fn.external_source(name=_SIZES, dtype=types.DALIDataType.FLOAT, ndim=1)
    images = fn.decoders.image_random_crop(
        jpegs,
        device=_decoder_device(device),
        output_type=types.DALIImageType.RGB,
        random_area=[crop.min_scale, crop.max_scale],
        random_aspect_ratio=[crop.min_ratio, crop.max_ratio],
        num_attempts=100,  # torchvision tries 10 then centre-crops; more tries, fewer fallbacks
        seed=decode_seed,
    )
    side = sizes[0]
    # One fused pass instead of resize then flip: the same pixels (antialiased linear
    # resize, then a horizontal mirror), without a second full-size copy per image.
    return fn.resize_crop_mirror(  # type: ignore[arg-type]
        images, resize_x=side, resize_y=side, antialias=True,
        mirror=fn.random.coin_flip(probability=0.5),
    )


@pipeline_def
def val_pipeline(device: str):
    """Decode, resize the shorter side to ``size / 0.875``, centre crop ``size``.

    Same inputs and output as :func:`train_pipeline`.
    """
    jpegs = fn.external_source(name=_JPEGS, dtype=types.DALIDataType.UINT8, ndim=1)
    sizes = fn.external_source(name=_SIZES, dtype=types.DALIDataType.FLOAT, ndim=1)
    images = fn.decoders.image(jpegs, device=_decoder_device(device), output_type=types.DALIImageType.RGB)
    side = sizes[0]
    resized = fn.resize(images, resize_shorter=side / VAL_CROP_FRACTION, antialias=True)
    return fn.crop(resized, crop_h=side, crop_w=side, out_of_bounds_policy="pad")  # type: ignore[arg-type]


@dataclass(frozen=True)
class PipelineSpec:
    """Everything that fixes a built pipeline (the key of a pipeline pool).

    Args:
        kind: train or val transform.
        device: ``"cpu"`` or ``"gpu"`` (GPU decodes with the ``mixed`` backend).
        max_batch_size: largest batch one run may carry.
        threads: DALI CPU worker threads.
        prefetch: runs kept in flight (scheduled in DALI before the oldest is
            collected), so reading the next batch overlaps decoding this one.
        crop: RandomResizedCrop limits (train only).
    """

    kind: AugmentKind
    device: str = "cpu"
    max_batch_size: int = 256
    threads: int = 2
    prefetch: int = 2
    crop: CropRange = CropRange()

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ConfigError(f"device: {self.device!r} is not cpu or gpu")
        for name in ("max_batch_size", "threads", "prefetch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")


def _build(spec: PipelineSpec, seed: int):
    common = dict(
        batch_size=spec.max_batch_size,
        num_threads=spec.threads,
        device_id=0 if spec.device == "gpu" else None,
        # Depth 1: DALI's own first-run prefetch would demand ``depth`` fed batches
        # up front; the runner schedules up to ``spec.prefetch`` runs itself instead.
        prefetch_queue_depth=1,
        exec_dynamic=True,
        seed=seed,
    )
    if spec.kind is AugmentKind.TRAIN:
        pipe = train_pipeline(device=spec.device, crop=spec.crop, **common)
    else:
        pipe = val_pipeline(device=spec.device, **common)
    pipe.build()
    return pipe


def _dali_reason(error: Exception) -> str:
    # DALI wraps the operator's message in a traceback; keep the line that says why.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "encountered:" in lines:
        return lines[lines.index("encountered:") + 1]
    return lines[0] if lines else type(error).__name__


class PipelineRunner:
    """One built pipeline, run on lists of encoded JPEGs. Not thread-safe: one
    stream (or one benchmark loop) owns a runner at a time.

    Args:
        spec: what to build.
        seed: DALI random seed (augmentation choices).
    """

    def __init__(self, spec: PipelineSpec, seed: int = 0) -> None:
        self.spec = spec
        self._pipe = _build(spec, seed)
        self._in_flight = 0

    def run(self, jpegs: Sequence[np.ndarray], image_size: int) -> np.ndarray:
        """Decode and augment one batch.

        Args:
            jpegs: encoded JPEG bytes, one uint8 array per sample (1..max_batch_size).
            image_size: output side in pixels.

        Returns:
            uint8 array ``[len(jpegs), image_size, image_size, 3]``.

        Raises:
            DataError: a sample could not be decoded (the runner must be discarded).
        """
        return next(self.run_many([(jpegs, image_size)]))

    def run_many(self, batches: Iterable[tuple[Sequence[np.ndarray], int]]) -> Iterator[np.ndarray]:
        """Run a sequence of batches keeping up to ``prefetch`` of them in flight,
        yielding outputs in order (same contract as :meth:`run` per batch)."""
        pending = iter(batches)
        exhausted = False
        while True:
            while not exhausted and self._in_flight < self.spec.prefetch:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                self._submit(*item)
            if self._in_flight == 0:
                return
            yield self._collect()

    def _submit(self, jpegs: Sequence[np.ndarray], image_size: int) -> None:
        if not 1 <= len(jpegs) <= self.spec.max_batch_size:
            raise ConfigError(f"batch of {len(jpegs)} outside 1..{self.spec.max_batch_size}")
        sizes = [np.array([image_size], dtype=np.float32)] * len(jpegs)
        self._pipe.feed_input(_JPEGS, list(jpegs))
        self._pipe.feed_input(_SIZES, sizes)
        self._pipe.schedule_run()
        self._in_flight += 1

    def _collect(self) -> np.ndarray:
        self._in_flight -= 1
        try:
            (out,) = self._pipe.outputs()
        except RuntimeError as e:
            raise DataError(f"decode failed: {_dali_reason(e)}") from e
        if self.spec.device == "gpu":
            out = out.as_cpu()
        return out.as_array()

    def drain(self) -> None:
        """Collect and drop every run still in flight (a stream stopped early)."""
        while self._in_flight:
            try:
                self._collect()
            except DataError:
                continue
