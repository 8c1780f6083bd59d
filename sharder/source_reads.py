"""Where an input's bytes are read from: a :class:`Source` turns a sample's source name
(``train/n01440764/n01440764_10026.JPEG``) into its bytes, wherever they lie.

- :class:`FileSource`: each input is a file of its own, under a folder
  (:class:`LocalFiles`) or an object store prefix (:class:`StoreFiles`);
- :class:`TarMemberSource`: each input is a member of a tar (the image-net.org
  download), read by its offset with one ``pread`` or one ranged GET, the tar never
  extracted (``sharder.download_tars`` finds the offsets).

A source is a small frozen value: it pickles by its root and, for tar members, by
their offsets (:meth:`Source.for_names` keeps only those a task reads), so the
sharder's worker processes and tasks of a cluster engine read with it. It holds no
open file or connection: a local read opens the file (one ``open`` and one
``pread``, as many system calls as reading a file of its own), and a store client
is made once per process (:func:`store_for`), since one made before a ``fork`` must
not be used after it (obstore's runtime threads do not survive one: a source that
reads a store says so with ``fork_safe``).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple, Protocol

from sharder.images import ProcessedImage
from shards.objects import ObjectMissing, ObjectShort, ObjectUrl
from shards.store import ObjectStore, StoreOptions

__all__ = [
    "FileSource", "Files", "LocalFiles", "Member", "Source", "StoreFiles", "TarMemberSource", "read_input",
    "store_for",
]


class Files(Protocol):
    """Named files under one root, read whole or by range. ``latency_bound``: a read
    mostly waits for a round trip (a store), so reads in threads overlap."""

    fork_safe: bool
    latency_bound: bool

    def read(self, name: str) -> bytes: ...

    def read_range(self, name: str, offset: int, size: int) -> bytes: ...

    def size(self, name: str) -> int: ...

    def shown(self, name: str) -> str: ...


@dataclass(frozen=True)
class LocalFiles:
    """Files under the folder ``root``."""

    root: Path
    fork_safe = True
    latency_bound = False

    def read(self, name: str) -> bytes:
        return (self.root / name).read_bytes()

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        """Raises OSError: unreadable, or it ends before ``offset + size``."""
        fd = os.open(os.path.join(self.root, name), os.O_RDONLY | os.O_CLOEXEC)  # (a Path costs more than the read)
        try:
            data = os.pread(fd, size, offset)
        finally:
            os.close(fd)
        if len(data) != size:
            raise OSError(f"{self.shown(name)} ends {size - len(data)} bytes before the end of a member at "
                          f"offset {offset} (changed since it was listed?)")
        return data

    def size(self, name: str) -> int:
        return (self.root / name).stat().st_size

    def shown(self, name: str) -> str:
        return str(self.root / name) if name else str(self.root)


_stores: dict[tuple[int, str, StoreOptions], ObjectStore] = {}
_stores_lock = threading.Lock()


def store_for(url: str, options: StoreOptions) -> ObjectStore:
    """This process's client of the store prefix ``url``, made at its first use here."""
    key = (os.getpid(), url, options)
    with _stores_lock:
        store = _stores.get(key)
        if store is None:
            store = _stores[key] = ObjectStore(ObjectUrl.parse(url), options)
    return store


@dataclass(frozen=True)
class StoreFiles:
    """Objects under the store prefix ``url`` (``s3://bucket/prefix``), read with the
    project's store client: its timeouts, its retries of transient failures."""

    url: str
    options: StoreOptions = field(default_factory=StoreOptions)
    fork_safe = False
    latency_bound = True

    @property
    def store(self) -> ObjectStore:
        return store_for(self.url, self.options)

    def read(self, name: str) -> bytes:
        return self.store.read_bytes(name)

    def read_range(self, name: str, offset: int, size: int) -> bytes:
        """Raises ObjectShort: the object ends before ``offset + size``."""
        return bytes(self.store.get_range(name, offset, size)) if size else b""

    def size(self, name: str) -> int:
        return self.store.head(name).size

    def shown(self, name: str) -> str:
        return str(ObjectUrl.parse(self.url) / name) if name else self.url


class Source(Protocol):
    """Where the inputs of a split are read from."""

    @property
    def fork_safe(self) -> bool:
        """Whether a process forked from one that read with it may read with it too."""
        ...

    def read(self, name: str) -> bytes:
        """The bytes of input ``name`` (a sample's source).

        Raises:
            OSError, ObjectMissing, ObjectShort: this input cannot be read.
            StoreRefused, StoreForbidden, StoreUnreachable: the store cannot be read.
        """
        ...

    def shown(self, name: str) -> str:
        """Input ``name`` as messages name it: its path, URL, or place in a tar."""
        ...

    def for_names(self, names: Iterable[str]) -> Source:
        """A source reading ``names`` (at least): what a task that reads only those is sent."""
        ...


@dataclass(frozen=True)
class FileSource:
    """Each input is the file of its name under ``files``."""

    files: Files

    @property
    def fork_safe(self) -> bool:
        return self.files.fork_safe

    def read(self, name: str) -> bytes:
        return self.files.read(name)

    def shown(self, name: str) -> str:
        return self.files.shown(name)

    def for_names(self, names: Iterable[str]) -> FileSource:
        return self


class Member(NamedTuple):
    """Where an input lies in a tar: ``tar`` (a file under the root), the offset and
    size of its bytes there, and ``inside``, its path in the tar (through a nested
    tar: ``n01440764.tar/n01440764_10026.JPEG``)."""

    tar: str
    offset: int
    size: int
    inside: str


@dataclass(frozen=True)
class TarMemberSource:
    """Each input is a member of a tar under ``files``, by ``members[name]``."""

    files: Files
    members: dict[str, Member]

    @property
    def fork_safe(self) -> bool:
        return self.files.fork_safe

    def read(self, name: str) -> bytes:
        member = self.members[name]
        return self.files.read_range(member.tar, member.offset, member.size)

    def shown(self, name: str) -> str:
        member = self.members.get(name)
        return f"{self.files.shown(member.tar)}/{member.inside}" if member else self.files.shown(name)

    def for_names(self, names: Iterable[str]) -> TarMemberSource:
        return TarMemberSource(self.files, {name: self.members[name] for name in names if name in self.members})


def read_input(source: Source, name: str) -> bytes | ProcessedImage:
    """The content of input ``name``, or a reject when it cannot be read.

    Raises:
        StoreRefused, StoreForbidden, StoreUnreachable: the store, not this input,
            cannot be read (the run stops; the same command resumes).
    """
    try:
        return source.read(name)
    except OSError as e:
        return ProcessedImage(reject=f"unreadable: {e.strerror or e}")
    except (ObjectMissing, ObjectShort) as e:
        return ProcessedImage(reject=f"unreadable: {e.detail}")
