"""The JPEG bytes and labels of a split, read from its WebDataset tars with the standard library.

The loaders that run in a virtual environment of their own (``bench/venvs.py``) cannot
import the project's shard reader (it needs numpy, pyarrow and grpc, which those
environments may lack or hold at other versions). They read the shards the way any tool
may (``shards/layout.py``): ``manifest.json`` names the split's tars, whose members are
``<key>.jpg`` (the stored JPEG bytes, the very ones the other loaders read) and
``<key>.cls`` (the label, ASCII digits); the half-scale copies (``<key>.half.jpg``) are
left out.
"""

from __future__ import annotations

import hashlib
import json
import tarfile
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sample", "manifest_digest", "read_samples", "split_tars"]

_MANIFEST = "manifest.json"  # shards.layout.MANIFEST_NAME, which this module cannot import
_IMAGE, _LABEL, _HALF = ".jpg", ".cls", ".half.jpg"


@dataclass(frozen=True)
class Sample:
    """One stored sample: its JPEG bytes and its label."""

    key: str
    jpeg: bytes
    label: int


def _manifest(shards: Path) -> dict:
    path = Path(shards) / _MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{path} not found; is {shards} a directory made by 'feeder shard'?")
    return json.loads(path.read_text())


def manifest_digest(shards: Path) -> str:
    """sha256 of the shard directory's manifest: it changes whenever the shards are made again.

    Raises:
        FileNotFoundError: ``shards`` has no manifest.
    """
    _manifest(shards)
    return hashlib.sha256((Path(shards) / _MANIFEST).read_bytes()).hexdigest()


def _tar_samples(path: Path, limit: int) -> list[Sample]:
    images: dict[str, bytes] = {}
    labels: dict[str, int] = {}
    with tarfile.open(path) as tar:
        for member in tar:
            name = member.name
            if not member.isfile() or name.endswith(_HALF):
                continue
            if name.endswith((_IMAGE, _LABEL)):
                data = tar.extractfile(member).read()  # type: ignore[union-attr]  # a regular file
                if name.endswith(_IMAGE):
                    images[name.removesuffix(_IMAGE)] = data
                else:
                    labels[name.removesuffix(_LABEL)] = int(data.decode("ascii"))
            if len(images) >= limit and all(k in labels for k in images):
                break
    missing = [k for k in images if k not in labels]
    if missing:
        raise ValueError(f"{path}: sample {missing[0]!r} has a .jpg and no .cls")
    return [Sample(k, images[k], labels[k]) for k in images][:limit]


def split_tars(shards: Path, split: str) -> list[str]:
    """The paths of ``split``'s tars relative to ``shards``, as the manifest lists them.

    Raises:
        FileNotFoundError: ``shards`` has no manifest.
        ValueError: the manifest has no split ``split``.
    """
    splits = _manifest(shards)["splits"]
    if split not in splits:
        raise ValueError(f"split {split!r} is not in {Path(shards) / _MANIFEST} (it has {', '.join(sorted(splits))})")
    return [entry["path"] for entry in splits[split]["shards"]]


def read_samples(shards: Path, split: str, limit: int) -> list[Sample]:
    """The first ``limit`` samples of ``split`` in write order (the sharder's shuffle).

    Raises:
        FileNotFoundError: ``shards`` has no manifest, or a tar it names is missing.
        ValueError: the manifest has no split ``split``, ``limit`` < 1, or a tar holds
            an image without its label.
    """
    if limit < 1:
        raise ValueError(f"limit must be at least 1, got {limit}")
    samples: list[Sample] = []
    for path in split_tars(shards, split):
        if len(samples) >= limit:
            break
        samples.extend(_tar_samples(Path(shards) / path, limit - len(samples)))
    return samples
