"""What fixes a built pipeline (:class:`PipelineSpec`, the key of the pipeline pool),
the names of the DALI graphs' inputs, and the one function that reads DALI's error text
(:func:`dali_decode_error`); the graphs and their build are :mod:`decode.dali_graphs`,
which alone loads DALI (half a daemon's start, where the window decoder decodes).

Crop windows and flips come from outside (:mod:`decode.augment`: a pure function of
seed, epoch and sample key), so a pipeline holds no random state and its identity
holds neither the crop ranges, the image size, the transform (train and validation
differ only in their windows) nor the batch size (up to ``max_batch_size``): one
built pipeline serves any of them. What decodes is chosen by name when it is built
(:mod:`decode.registry`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from core.errors import ConfigError
from decode.jobs import SampleDecodeError

__all__ = [
    "ANCHORS",
    "JPEGS",
    "SHAPES",
    "PipelineSpec",
    "dali_decode_error",
]

# Names of the graphs' external sources (the finishing stage's are :mod:`decode.finish`'s).
JPEGS, ANCHORS, SHAPES = "jpegs", "anchors", "shapes"


@dataclass(frozen=True)
class PipelineSpec:
    """Everything that fixes a built pipeline: only what changes its pixels or the
    resources it holds.

    Args:
        device: ``"cpu"`` or ``"gpu"`` (GPU decodes with the ``mixed`` backend).
        device_id: CUDA device index in this process (GPU only; 0 on the CPU).
        max_batch_size: largest batch one run may carry.
        threads: decode threads (DALI's CPU workers, or the window decoder's), and
            resize threads on the CPU path.
        prefetch: runs kept in flight, so decoding the next batch overlaps resizing
            this one.
        antialias: resize filter: plain bilinear (False, the default: tf.data's
            filter, 1.7x cheaper on the CPU than the antialiased one) or bilinear
            widened when downscaling (True: torchvision's PIL path). On the GPU,
            DALI fixes it when the pipeline is built, hence it is part of the spec.
        cpu_decoder: the CPU path's decoder, by name (:data:`decode.registry.DECODERS`:
            ``"libjpeg-turbo"``, the window decoder of :mod:`shards.jpeg`, ``"dali"``,
            DALI's ROI decode), or ``"auto"``: the first that can run here. The name
            is checked when the decoder is made (the registry may grow until then).
        hw_decoder_load: GPU only: the share of each batch's JPEG data DALI gives the
            GPU's hardware JPEG engines (separate from the SMs a training step
            uses; ignored on a GPU without them). DALI's default is 0.65.
        cpu_decode_share: GPU only: the share of each batch decoded on the CPU by the
            window decoder and uploaded (no SM time): 0 decodes all of it on the GPU,
            1 all of it on the CPU, None lets the decoder tune it from what it measures
            (:mod:`decode.split_decoder`). Where the window decoder was not built, 0.
        photometric: GPU only: its graph has the photometric steps
            (:func:`decode.finish.finish_graph`), fed each sample's factors; the CPU
            finishing stage needs no such choice when it is built.
    """

    device: str = "cpu"
    device_id: int = 0
    max_batch_size: int = 256
    threads: int = 2
    prefetch: int = 2
    antialias: bool = False
    cpu_decoder: str = "auto"
    hw_decoder_load: float = 0.65
    cpu_decode_share: float | None = 0.0
    photometric: bool = False

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ConfigError(f"device: {self.device!r} is not cpu or gpu")
        for name in ("hw_decoder_load", "cpu_decode_share"):
            value = getattr(self, name)
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be in 0..1, got {value}")
        for name in ("max_batch_size", "threads", "prefetch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.device_id < 0 or (self.device == "cpu" and self.device_id != 0):
            raise ConfigError(f"device_id: {self.device_id} is not a CUDA index of a gpu spec")


# DALI names a failing sample in two shapes (nvidia-dali 1.5x): "Failed to decode
# sample #1 : <reason>" (the reason is often empty), and "nvImageCodec failure: '#4'"
# where the number is an error code, not a sample.
_NAMED_SAMPLE = re.compile(r"Failed to decode sample #(\d+)\s*:?\s*(.*)")


def dali_decode_error(error: Exception, batch_size: int) -> SampleDecodeError:
    """The :class:`SampleDecodeError` of a DALI run that raised ``error`` on a batch of
    ``batch_size`` samples: the line of DALI's message that says why (it wraps the
    operator's message in the graph's traceback, after ``encountered:``), and the
    failing sample where that line names one."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "encountered:" in lines[:-1]:
        detail = lines[lines.index("encountered:") + 1]
    else:
        detail = lines[0] if lines else type(error).__name__
    named = _NAMED_SAMPLE.search(detail)
    if named is None or int(named.group(1)) >= batch_size:
        return SampleDecodeError(detail)
    reason = named.group(2).strip() or "DALI gave no reason"
    return SampleDecodeError(reason, {int(named.group(1)): reason})
