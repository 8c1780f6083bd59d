"""``manifest.json``: what a shard directory holds, written last by ``feeder shard``.

Shape (``FORMAT_VERSION`` 1)::

    {"format_version": 1, "layout": "ilsvrc"|"folders", "source": str,
     "classes": [sorted class names],                # label = index in this list
     "splits": {"train": {"num_samples", "accepted", "rejected", "reencoded", "ignored", "inputs",
                          "per_class": {class name: accepted count},
                          "index": "train/index.parquet",
                          "shards": [{"path", "index", "samples", "bytes", "sha256"}],
                          "lmdb": {"path", "samples", "bytes", "sha256"} (with lmdb),
                          "rejects": [{"source", "reason"}]}, ...},
     "options": {...}}

``accepted + rejected == inputs``; ``reencoded`` counts accepted inputs stored as a new
RGB JPEG (odd formats, ``--max-side``, ``--quality``) rather than byte for byte.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from feeder.errors import DataError, NotFound
from sharder.layout import FORMAT_VERSION, MANIFEST_NAME
from sharder.writers import fsync_dir

__all__ = ["read_manifest", "write_json_atomic"]


def write_json_atomic(path: Path, obj: Any, *, indent: int | None = 1) -> None:
    """Write ``obj`` as JSON to ``path`` via a temporary file, fsync and rename.

    Args:
        path: final file name.
        obj: anything ``json.dump`` takes.
        indent: as in ``json.dump``; None for compact machine-only files.
    """
    temp = path.with_name(path.name + ".tmp")
    with open(temp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=indent)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temp, path)
    fsync_dir(path.parent)


def read_manifest(root: Path) -> dict[str, Any]:
    """The manifest of shard directory ``root``.

    Raises:
        NotFound: no manifest (not a shard directory, or an unfinished run).
        DataError: unreadable JSON or a format version this code does not know.
    """
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise NotFound(f"{path} does not exist (not a shard directory, or sharding did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest
