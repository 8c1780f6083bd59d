"""Which sample of a failed batch is the bad one: DALI reports that a batch failed to
decode, not which image; each candidate is decoded alone with PIL to name it."""

from __future__ import annotations

import io

import numpy as np
from PIL import Image

from core.errors import DataError
from shards.reader import SplitIndex

__all__ = ["name_bad_sample"]

_NAMED_IF_UNKNOWN = 8  # keys listed when no candidate fails on its own


def name_bad_sample(split: SplitIndex, candidates: list[int], error: DataError) -> DataError:
    """``error`` restated with the key of the first of ``candidates`` (sample indices)
    that does not decode, or with the first few keys when each decodes alone."""
    for index in candidates:
        try:
            data = split.read(index)
        except DataError as unreadable:  # the shard itself is damaged: that is the news
            return unreadable
        if not _decodes(data):
            return DataError(f"{split.split}/{split.keys[index]}: {error}")
    keys = ", ".join(split.keys[i] for i in candidates[:_NAMED_IF_UNKNOWN])
    return DataError(f"{split.split}: one of {keys}...: {error}")


def _decodes(data: np.ndarray) -> bool:
    try:
        with Image.open(io.BytesIO(data.tobytes())) as image:
            image.load()
    except Exception:  # noqa: BLE001 - PIL raises many types for bad bytes
        return False
    return True
