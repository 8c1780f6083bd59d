"""Reading a shard directory's ``manifest.json`` (:mod:`shards.layout` has its shape),
with the type of every field the reader relies on checked before it is used.

A manifest is JSON that people and tools edit; valid JSON of the wrong shape (a list,
a count written as a string) is refused here with one line naming the file and the
field, instead of failing later as a Python error deep inside the reader.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING, Any, TypeAlias

from core.errors import DataError, NotFound
from shards.layout import FORMAT_VERSION, MANIFEST_NAME

if TYPE_CHECKING:
    from shards.remote_root import ObjectPath

__all__ = ["Root", "is_inside", "read_manifest", "read_served_manifest"]

# A shard directory: local, or in an object store (read through the same calls).
Root: TypeAlias = "Path | ObjectPath"

# Counts of a split entry, and of each of its shards, that the reader uses when
# present (``feeder verify`` reads the others).
_SPLIT_COUNTS = ("num_samples", "index_version")
_SHARD_COUNTS = ("samples", "bytes")
_ABSENT = object()  # a field the manifest lacks, told apart from a JSON null


def _json_kind(value: object) -> str:
    """What ``value`` is in JSON words, for a message: ``an object``, ``a list``, ``a
    string``, ``a number``, ``true`` / ``false`` or ``null``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    kinds = ((dict, "an object"), (list, "a list"), (str, "a string"), ((int, float), "a number"))
    return next((kind for types, kind in kinds if isinstance(value, types)), "null")


def _refuse(path: Root, field: str, value: object, expected: str) -> DataError:
    """``path: field: expected ..., got ...`` (no field: the whole file)."""
    where = f"{path}: {field}" if field else str(path)
    if value is _ABSENT:
        return DataError(f"{where}: missing, expected {expected}")
    return DataError(f"{where}: expected {expected}, got {_json_kind(value)}")


def _object(path: Root, field: str, value: object, expected: str = "an object") -> dict[str, Any]:
    """``value`` where it is a JSON object.

    Raises:
        DataError: anything else (names the file, the field and what it holds).
    """
    if not isinstance(value, dict):
        raise _refuse(path, field, value, expected)
    return value


def _list(path: Root, field: str, value: object, expected: str) -> list[Any]:
    """``value`` where it is a JSON list (raises as :func:`_object`)."""
    if not isinstance(value, list):
        raise _refuse(path, field, value, expected)
    return value


def _string(path: Root, field: str, value: object, expected: str) -> str:
    """``value`` where it is a JSON string (raises as :func:`_object`)."""
    if not isinstance(value, str):
        raise _refuse(path, field, value, expected)
    return value


def _count(path: Root, field: str, value: object) -> int:
    """``value`` where it is an integer of 0 or more (not ``true`` / ``false``;
    raises as :func:`_object`)."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise _refuse(path, field, value, "an integer")
    if value < 0:
        raise DataError(f"{path}: {field}: expected a count (0 or more), got {value}")
    return value


def read_manifest(root: Root) -> dict[str, Any]:
    """The manifest of shard directory ``root``: a JSON object of a format version
    this code reads.

    Raises:
        NotFound: no manifest (not a shard directory, or an unfinished run).
        DataError: unreadable JSON, JSON that is not an object, or a format version
            this code does not know.
    """
    path = root / MANIFEST_NAME
    if not path.is_file():
        raise NotFound(f"{path} does not exist (not a shard directory, or sharding did not finish)")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise DataError(f"{path}: unreadable manifest: {e}") from e
    manifest = _object(path, "", manifest, "a JSON object")
    if manifest.get("format_version") != FORMAT_VERSION:
        raise DataError(f"{path}: format_version {manifest.get('format_version')!r}, expected {FORMAT_VERSION}")
    return manifest


def read_served_manifest(root: Root) -> dict[str, Any]:
    """The manifest of ``root``, with the fields serving reads of the right types:
    ``classes`` a list of strings, ``splits`` an object of at least one split, each
    split an object whose counts are integers and whose ``shards`` are objects with a
    string ``path``.

    Raises:
        NotFound: ``root`` or its manifest does not exist.
        DataError: as :func:`read_manifest`, or a field of another type (names the
            file and the field, e.g. ``splits.train.num_samples``).
    """
    if not root.is_dir():
        raise NotFound(f"{root}: no such shard directory")
    manifest = read_manifest(root)
    path = root / MANIFEST_NAME
    classes = _list(path, "classes", manifest.get("classes", _ABSENT), "a list of class names")
    for i, name in enumerate(classes):
        _string(path, f"classes[{i}]", name, "a class name (a string)")
    splits = _object(path, "splits", manifest.get("splits", _ABSENT), "an object of splits")
    if not splits:
        raise DataError(f"{path}: splits: lists no splits")
    for split, info in splits.items():
        _check_split(path, f"splits.{split}", info)
    return manifest


def _check_split(path: Root, field: str, value: object) -> None:
    info = _object(path, field, value)
    for count in (c for c in _SPLIT_COUNTS if c in info):
        _count(path, f"{field}.{count}", info[count])
    for i, item in enumerate(_list(path, f"{field}.shards", info.get("shards", []), "a list of shards")):
        where = f"{field}.shards[{i}]"
        shard = _object(path, where, item)
        _string(path, f"{where}.path", shard.get("path", _ABSENT), "a path (a string)")
        _inside(path, f"{where}.path", shard["path"])
        for count in (c for c in _SHARD_COUNTS if c in shard):
            _count(path, f"{where}.{count}", shard[count])


def _inside(path: Root, field: str, value: str) -> None:
    """A file the manifest names is a relative path inside the shard directory: the
    daemon opens it under the root, and must not be led to read any other file."""
    if not is_inside(value):
        raise DataError(f"{path}: {field}: {value[:200]!r} is not a relative path inside the shard directory")


def is_inside(relative: str) -> bool:
    """Whether ``relative`` names a file under a directory: relative, without ``..``
    and without a NUL."""
    parts = PurePosixPath(relative).parts
    return bool(parts) and not relative.startswith("/") and ".." not in parts and "\0" not in relative
