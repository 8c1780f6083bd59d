"""The RandomResizedCrop limits a request may set (:class:`CropRange`), checked as the
daemon reads them: as float32, the request's type."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass

from core.errors import InvalidArgument

__all__ = ["CROP_LIMITS", "CROP_RATIOS", "MIN_CROP_SCALE", "CropRange"]

# Below 1 % of the area a crop of a typical photo is a few pixels wide; ratios past
# 10:1 are slivers.
MIN_CROP_SCALE = 0.01
CROP_RATIOS = (0.1, 10.0)
# Each limit's range, by field name (the request's fields of the same names).
CROP_LIMITS: dict[str, tuple[float, float]] = {
    "min_scale": (MIN_CROP_SCALE, 1.0),
    "max_scale": (MIN_CROP_SCALE, 1.0),
    "min_ratio": CROP_RATIOS,
    "max_ratio": CROP_RATIOS,
}
_FLOAT32_MAX = 3.4028234663852886e38


def _f32(value: float) -> float:
    """``value`` rounded to float32 (as it is where out of float32's range)."""
    return value if abs(value) > _FLOAT32_MAX else struct.unpack("f", struct.pack("f", value))[0]


@dataclass(frozen=True)
class CropRange:
    """RandomResizedCrop limits: area fraction and aspect ratio (width / height).

    Raises:
        InvalidArgument: a limit outside :data:`MIN_CROP_SCALE`..1 (scales) or
            :data:`CROP_RATIOS` (ratios), or a minimum above its maximum (the message
            starts with the field's name).
    """

    min_scale: float = 0.08
    max_scale: float = 1.0
    min_ratio: float = 3 / 4
    max_ratio: float = 4 / 3

    def __post_init__(self) -> None:
        for name, (low, high) in CROP_LIMITS.items():
            value = getattr(self, name)
            # As float32, the request's type: a limit passes however it was rounded.
            if not (math.isfinite(value) and _f32(low) <= _f32(value) <= _f32(high)):
                raise InvalidArgument(f"{name}: {value:g} is not in {low:g}..{high:g}")
        for lower, upper in (("min_scale", "max_scale"), ("min_ratio", "max_ratio")):
            if getattr(self, lower) > getattr(self, upper):
                raise InvalidArgument(f"{lower}: {getattr(self, lower):g} is above {upper} {getattr(self, upper):g}")
