"""Bad input, treated alike by the sharder (``feeder shard``) and the daemon
(``feeder serve``): one pixel limit and one set of words for the error policy.
Importable without Pillow (``feeder --help`` must not load it)."""

from __future__ import annotations

import enum

__all__ = ["DEFAULT_MAX_PIXELS", "ON_ERROR", "OnError"]

# Pillow's own decompression-bomb threshold (``PIL.Image.MAX_IMAGE_PIXELS``,
# 1 GiB / 4 / 3, about 9459 x 9459): far above camera photos, so only bombs and
# unusual scans reach it.
DEFAULT_MAX_PIXELS = 89_478_485


class OnError(str, enum.Enum):
    """What to do with an input that cannot be used: ``skip`` it (counted and named)
    or ``fail`` (stop, naming it)."""

    SKIP = "skip"
    FAIL = "fail"


ON_ERROR = tuple(policy.value for policy in OnError)
