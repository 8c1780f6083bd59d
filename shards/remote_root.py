"""A shard directory in an object store, seen through paths: :class:`ObjectPath` has
the few operations of :class:`pathlib.Path` that the manifest and index readers
(:mod:`shards.index`) and ``feeder verify`` use, so they read a remote root with
the same code and the same checks as a local one, and their messages name the URL.

- ``/``, ``name``, ``str()`` (the URL);
- ``is_file()``, ``is_dir()``, ``stat().st_size`` from the listing of the object's
  "directory" (one LIST each, kept: opening a split with 1,000 tars costs one
  request, not 1,000 HEADs);
- ``read_text()`` / ``read_bytes()``: one GET;
- ``os.fspath()``: a local copy, downloaded once into the root's mirror (a private
  temporary directory), for what needs a real file (Parquet, ``tarfile``, LMDB).
  Large copies are dropped least recently used past ``mirror_bytes``.

Sample bytes are not read this way (see :mod:`shards.ranged`).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import NamedTuple

from shards.objects import ObjectUrl
from shards.store import ObjectInfo, ObjectStore

__all__ = ["ObjectPath", "RemoteRoot"]

_MIRROR_BYTES = 2 << 30  # local copies kept at once (verify's tars), besides the last one
_OPEN_WINDOW_S = 5.0  # opening a root: how long transient failures are retried


class _Stat(NamedTuple):
    st_size: int


class RemoteRoot:
    """A shard directory at ``store.root``: its listings and local copies.

    Args:
        store: the store, rooted at the shard directory's URL.
        window_s: how long its listings and small reads retry transient failures
            (short: they run when a daemon starts or verify begins, and a store
            that is not there should say so soon).
        mirror_bytes: the most bytes of local copies kept at once.
    """

    def __init__(self, store: ObjectStore, window_s: float = _OPEN_WINDOW_S, mirror_bytes: int = _MIRROR_BYTES) -> None:
        self.store, self.window_s, self.mirror_bytes = store, window_s, mirror_bytes
        self._listings: dict[str, tuple[dict[str, ObjectInfo], set[str]]] = {}
        self._copies: OrderedDict[str, int] = OrderedDict()  # name -> bytes, oldest first
        self._lock = threading.Lock()
        self._mirror = Path(tempfile.mkdtemp(prefix="feeder-mirror-"))
        weakref.finalize(self, shutil.rmtree, self._mirror, True)

    @property
    def url(self) -> ObjectUrl:
        return self.store.root

    def path(self, name: str = "") -> ObjectPath:
        return ObjectPath(self, name.strip("/"))

    def _listing(self, directory: str) -> tuple[dict[str, ObjectInfo], set[str]]:
        """(objects, sub-directories) directly under ``directory``, by full name."""
        with self._lock:
            found = self._listings.get(directory)
        if found is None:
            found = self.store.list_directory(directory, self.window_s)
            with self._lock:
                self._listings[directory] = found
        return found

    def info(self, name: str) -> ObjectInfo | None:
        """Size and ETag of object ``name``, None where there is none."""
        return self._listing(name.rpartition("/")[0])[0].get(name)

    def is_dir(self, name: str) -> bool:
        objects, directories = self._listing(name)
        return bool(objects or directories)

    def read_bytes(self, name: str) -> bytes:
        return self.store.read_bytes(name, self.window_s)

    def local_copy(self, name: str) -> Path:
        """A local file with object ``name``'s bytes (every object under it, for a
        directory), downloaded once."""
        target = self._mirror / name
        with self._lock:
            if name in self._copies:
                self._copies.move_to_end(name)
                return target
        names = [name] if self.info(name) is not None else self._all_under(name)
        size = 0
        for each in names:
            size += self._download(each, self._mirror / each)
        with self._lock:
            self._copies[name] = size
            self._drop_old_copies(keep=name)
        return target

    def _all_under(self, directory: str) -> list[str]:
        objects, directories = self._listing(directory)
        return [*objects, *(n for d in sorted(directories) for n in self._all_under(d))]

    def _download(self, name: str, target: Path) -> int:
        info = self.info(name)
        size = info.size if info is not None else self.store.head(name, self.window_s).size
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(target.name + ".part")
        with open(partial, "wb") as out:
            for chunk in self.store.chunks(name, size):
                out.write(chunk)
        partial.rename(target)
        return size

    def _drop_old_copies(self, keep: str) -> None:
        """Past ``mirror_bytes``: the oldest copies go (a reader holding one open keeps
        reading it)."""
        while sum(self._copies.values()) > self.mirror_bytes and len(self._copies) > 1:
            oldest = next(iter(self._copies))
            if oldest == keep:
                break
            self._copies.pop(oldest)
            target = self._mirror / oldest
            shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


class ObjectPath:
    """An object (or a prefix) under a :class:`RemoteRoot`, used like a ``Path``."""

    def __init__(self, root: RemoteRoot, name: str) -> None:
        self._root, self._name = root, name

    @property
    def url(self) -> ObjectUrl:
        return self._root.url / self._name if self._name else self._root.url

    def __str__(self) -> str:
        return str(self.url)

    def __repr__(self) -> str:
        return f"ObjectPath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ObjectPath) and str(other) == str(self)

    def __hash__(self) -> int:
        return hash(str(self))

    def __truediv__(self, part: str | os.PathLike[str]) -> ObjectPath:
        part = os.fspath(part).strip("/")
        return ObjectPath(self._root, f"{self._name}/{part}" if self._name else part)

    def __fspath__(self) -> str:
        return str(self._root.local_copy(self._name))

    @property
    def name(self) -> str:
        return self._name.rpartition("/")[2]

    def is_file(self) -> bool:
        return bool(self._name) and self._root.info(self._name) is not None

    def is_dir(self) -> bool:
        return self._root.is_dir(self._name)

    def exists(self) -> bool:
        return self.is_file() or self.is_dir()

    def stat(self) -> _Stat:
        info = self._root.info(self._name)
        if info is None:
            raise FileNotFoundError(f"{self}: no such object")
        return _Stat(info.size)

    def read_bytes(self) -> bytes:
        return self._root.read_bytes(self._name)

    def read_text(self, encoding: str | None = "utf-8", errors: str | None = None) -> str:
        return self.read_bytes().decode(encoding or "utf-8", errors or "strict")
