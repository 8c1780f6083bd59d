"""A real S3 server for the tests (SeaweedFS, :mod:`bench.seaweedfs`), started once per
session by the ``s3_server`` fixture (``tests/conftest.py``), fresh buckets on it,
shard directories copied there, and the environment that points clients at it."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.seaweedfs import SeaweedFS
from shards.objects import ObjectUrl
from shards.store import ObjectStore, StoreOptions

__all__ = ["TcpProxy", "fresh_bucket", "pointed_at", "store_of", "upload_tree"]

_buckets = itertools.count()


def fresh_bucket(server: SeaweedFS, stem: str = "t") -> str:
    """The name of a new, empty bucket on ``server`` (created), unique in this session."""
    name = f"{stem}-{os.getpid()}-{next(_buckets)}".lower()
    server.filesystem().create_dir(name)
    return name


@contextmanager
def pointed_at(server: SeaweedFS, **changes: str) -> Iterator[None]:
    """The standard AWS variables set for ``server`` (``changes`` on top) while the
    block runs, the previous ones back afterwards."""
    wanted = server.environment() | changes
    before = {name: os.environ.get(name) for name in wanted}
    os.environ.update(wanted)
    try:
        yield
    finally:
        for name, value in before.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def store_of(server: SeaweedFS, url: str, **options: float) -> ObjectStore:
    """An ObjectStore rooted at ``url`` on ``server`` (its identity, no retries unless asked)."""
    with pointed_at(server):
        return ObjectStore(ObjectUrl.parse(url), StoreOptions(endpoint_url=server.endpoint_url, **options))


def upload_tree(server: SeaweedFS, local: Path, url: str) -> str:
    """Every file under ``local`` copied to ``url`` (``s3://bucket/prefix``), the
    manifest last; returns ``url``."""
    store = store_of(server, url)
    files = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: p.name == "manifest.json")
    for path in files:
        store.put_file(path.relative_to(local).as_posix(), path)
    return url


class TcpProxy:
    """A TCP forwarder in front of a server, to make its faults: ``frozen`` connections
    (bytes stop flowing both ways: requests hang until their timeout) and ``reset``
    ones (the next connections are accepted and reset at once). Used as the endpoint
    of a store client: ``proxy.url``.

    Args:
        upstream: ``host:port`` of the real server.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._resets = 0
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def reset_next(self, connections: int) -> None:
        """The next ``connections`` connections are reset as soon as they are accepted,
        and every open one now."""
        with self._lock:
            self._resets += connections
            for sock in self._sockets:
                _reset(sock)
            self._sockets.clear()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                reset, self._resets = self._resets > 0, max(0, self._resets - 1)
            if reset:
                _reset(client)
                continue
            try:
                server = socket.create_connection(self._upstream)
            except OSError:
                _reset(client)
                continue
            with self._lock:
                self._sockets += [client, server]
            for source, target in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, target), daemon=True).start()

    def _pump(self, source: socket.socket, target: socket.socket) -> None:
        try:
            while data := source.recv(1 << 16):
                self._flowing.wait()
                target.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (source, target):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self._closed = True
        self._flowing.set()
        self._listener.close()
        self.reset_next(0)


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0), as a crashed peer does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
