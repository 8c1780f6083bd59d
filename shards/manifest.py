"""A shard directory's ``manifest.json`` as records (:mod:`shards.layout` has its
shape in words): one parser, :func:`read_manifest` / :meth:`Manifest.from_json`, that
checks the type of every field before anything uses it, and one writer,
:func:`shards.writers.write_manifest`.

A manifest is JSON that people and tools edit; valid JSON of the wrong shape (a list,
a count written as a string) is refused here with one line naming the file and the
field, instead of failing later as a Python error deep inside the reader.

Keys the sharder has written since the first version are required; those added
later without a version change (``reencoded``, ``index_version``, ``index_sha256``,
``skipped_links``, ``empty_classes``) and ``lmdb`` (with ``--formats lmdb`` only) are
optional, ``None`` where the manifest lacks them, so older manifests still read and
write back unchanged. A new key is a new ``FORMAT_VERSION`` (``docs/design.md``,
"Adding a manifest key").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypeAlias

from core.errors import DataError, NotFound
from shards.json_records import JsonRecord, RecordError, spec
from shards.layout import MANIFEST_NAME

if TYPE_CHECKING:
    from shards.remote_root import ObjectPath

__all__ = [
    "FORMAT_VERSION",
    "FORMAT_VERSIONS",
    "LmdbEntry",
    "Manifest",
    "Root",
    "ShardEntry",
    "SkippedInput",
    "SplitEntry",
    "is_inside",
    "parse_manifest",
    "read_manifest",
]

# A shard directory: local, or in an object store (read through the same calls).
Root: TypeAlias = "Path | ObjectPath"

FORMAT_VERSION = 1  # the manifest format this code writes (a new key is a new version)
FORMAT_VERSIONS = (1,)  # the manifest format versions this code reads


def is_inside(relative: str) -> bool:
    """Whether ``relative`` names a file under a directory: relative, without ``..``
    and without a NUL."""
    parts = PurePosixPath(relative).parts
    return bool(parts) and not relative.startswith("/") and ".." not in parts and "\0" not in relative


def _outside(value: str) -> str | None:
    """A file the manifest names is a relative path inside the shard directory: the
    daemon opens it under the root, and must not be led to read any other file."""
    return None if is_inside(value) else f"{value[:200]!r} is not a relative path inside the shard directory"


def _no_splits(value: Mapping[str, object]) -> str | None:
    return None if value else "lists no splits"


_PATH = spec(expected="a path (a string)", check=_outside)
_COUNT = spec(count=True)


@dataclass(frozen=True, kw_only=True)
class ShardEntry(JsonRecord):
    """One WebDataset tar of a split: its path and its DALI ``.idx``'s (relative to
    the shard directory), its samples, its size in bytes and its hex sha256."""

    path: str = field(metadata=_PATH)
    index: str
    samples: int = field(metadata=_COUNT)
    bytes: int = field(metadata=_COUNT)
    sha256: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class LmdbEntry(JsonRecord):
    """A split's LMDB (``<split>/lmdb``): its samples, and the size in bytes and hex
    sha256 of its ``data.mdb``."""

    path: str = field(metadata=_PATH)
    samples: int = field(metadata=_COUNT)
    bytes: int = field(metadata=_COUNT)
    sha256: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SkippedInput(JsonRecord):
    """An input not sharded (a reject, a symbolic link not followed): its path under
    SRC and why."""

    source: str
    reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class SplitEntry(JsonRecord):
    """One split: its counts (``accepted + rejected == inputs``), its samples per
    class name, its index and shards, and the inputs it left out."""

    num_samples: int = field(metadata=_COUNT)
    accepted: int = field(metadata=_COUNT)
    rejected: int = field(metadata=_COUNT)
    reencoded: int | None = field(default=None, metadata=_COUNT)
    ignored: int = field(metadata=_COUNT)
    inputs: int = field(metadata=_COUNT)
    per_class: dict[str, int]
    index: str = field(metadata=_PATH)
    index_version: int | None = field(default=None, metadata=_COUNT)
    shards: tuple[ShardEntry, ...] = field(metadata=spec(expected="a list of shards"))
    rejects: tuple[SkippedInput, ...]
    skipped_links: tuple[SkippedInput, ...] | None = None
    empty_classes: tuple[str, ...] | None = None
    index_sha256: str | None = None
    lmdb: LmdbEntry | None = None
    extra: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Manifest(JsonRecord):
    """What a shard directory holds (``manifest.json``): the label of a sample is the
    index of its class in ``classes``; ``options`` are the sharder's, as it recorded
    them (:meth:`sharder.config.ShardConfig.options`)."""

    format_version: int
    layout: str
    source: str
    classes: tuple[str, ...] = field(metadata=spec(expected="a list of class names", item="a class name (a string)"))
    splits: dict[str, SplitEntry] = field(metadata=spec(expected="an object of splits", check=_no_splits))
    options: dict[str, Any]
    extra: Mapping[str, Any] = field(default_factory=dict)


def parse_manifest(value: object, path: Root | str) -> Manifest:
    """The manifest held by JSON value ``value`` (read from ``path``, for messages).

    Raises:
        DataError: not a JSON object, a format version this code does not read, or a
            field of another type (names ``path`` and the field, e.g.
            ``splits.train.num_samples``).
    """
    if isinstance(value, dict) and value.get("format_version") not in FORMAT_VERSIONS:
        expected = " or ".join(str(v) for v in FORMAT_VERSIONS)
        raise DataError(f"{path}: format_version {value.get('format_version')!r}, expected {expected}")
    try:
        return Manifest.from_json(value, expected="a JSON object")
    except RecordError as e:
        raise DataError(f"{path}: {e}") from e


def read_manifest(root: Root) -> Manifest:
    """The manifest of shard directory ``root``.

    Raises:
        NotFound: ``root`` or its manifest does not exist (not a shard directory, or an
            unfinished run).
        DataError: unreadable JSON, or as :func:`parse_manifest`.
    """
    if not root.is_dir():
        raise NotFound(f"{root}: no such shard directory")
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise NotFound(f"{path} does not exist (not a shard directory, or sharding did not finish)")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    return parse_manifest(value, path)
