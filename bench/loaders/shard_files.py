"""Read-only access to a shard directory for the loaders that do not use feeder."""

from __future__ import annotations

import mmap
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq

from sharder.layout import index_path

__all__ = ["SampleIndex", "read_index", "read_jpegs", "tar_paths"]


@dataclass(frozen=True)
class SampleIndex:
    """Columns of ``<split>/index.parquet`` that the loaders need."""

    labels: list[int]
    shards: list[str]
    offsets: list[int]
    sizes: list[int]

    def __len__(self) -> int:
        return len(self.labels)


def read_index(root: Path, split: str) -> SampleIndex:
    """The sample index of ``split`` under shard directory ``root``.

    Raises:
        FileNotFoundError: ``root`` has no index for ``split``.
    """
    table = pq.read_table(index_path(root, split), columns=["label", "shard", "offset", "size"])
    columns = table.to_pydict()
    return SampleIndex(columns["label"], columns["shard"], columns["offset"], columns["size"])


def tar_paths(root: Path, split: str) -> list[Path]:
    """The WebDataset tars of ``split``, in shard order."""
    return sorted((root / split).glob("*.tar"))


def read_jpegs(root: Path, index: SampleIndex, limit: int | None = None) -> list[bytes]:
    """The encoded bytes of the first ``limit`` samples of ``index`` (all when None)."""
    count = len(index) if limit is None else min(limit, len(index))
    maps: dict[str, mmap.mmap] = {}
    out = []
    for i in range(count):
        shard = index.shards[i]
        if shard not in maps:
            with open(root / shard, "rb") as f:
                maps[shard] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        out.append(bytes(maps[shard][index.offsets[i] : index.offsets[i] + index.sizes[i]]))
    for m in maps.values():
        m.close()
    return out
