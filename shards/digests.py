"""A shard directory's identity as a daemon serving it reports it (``ListDatasets``):
the digest of its manifest and of each split's index. Read without opening the
directory for serving (no index is parsed, no tar looked at), so that a launcher can
tell whether the daemon already serving a name serves this directory."""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from pathlib import Path

from shards.layout import file_sha256, index_path
from shards.manifest import Manifest, Root, read_manifest
from shards.objects import ObjectUrl, is_remote
from shards.remote_root import RemoteRoot
from shards.store import ObjectStore, StoreCounters, StoreOptions

__all__ = ["DatasetDigests", "dataset_digests", "manifest_sha256"]


def manifest_sha256(manifest: Manifest) -> str:
    """The manifest's identity: the sha256 of its JSON, every key it holds, sorted."""
    return hashlib.sha256(json.dumps(manifest.to_json(), sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class DatasetDigests:
    """What a daemon serving a shard directory says it serves.

    Attributes:
        manifest_sha256: :func:`manifest_sha256` of its manifest.
        index_sha256: split name -> sha256 of its ``index.parquet``.
    """

    manifest_sha256: str
    index_sha256: dict[str, str]


def dataset_digests(root: Path | str, options: StoreOptions | None = None) -> DatasetDigests:
    """The digests of the shard directory ``root`` (a path, or an object store URL
    read with ``options``).

    Raises:
        NotFound: no shard directory, or no manifest, at ``root``.
        DataError: its manifest is unreadable.
        OSError: an index cannot be read.
    """
    top: Root = Path(root)
    if isinstance(root, str) and is_remote(root):
        store = ObjectStore(ObjectUrl.parse(root), options or StoreOptions(), StoreCounters(), threading.Event())
        top = RemoteRoot(store).path()
    manifest = read_manifest(top)
    return DatasetDigests(manifest_sha256(manifest),
                          {split: file_sha256(index_path(top, split)) for split in manifest.splits})
