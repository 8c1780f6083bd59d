"""A TCP proxy in front of a daemon, for fault tests: it forwards every connection to
the target until told to reset them all (as a load balancer or a proxy restart does:
the client sees its calls fail and connects again) or to refuse new ones."""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType

__all__ = ["Proxy"]

_CHUNK = 1 << 16


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target`` (``host:port``); a context manager.

    Attributes:
        address: where clients connect (``127.0.0.1:<port>``).
        resets: how many times :meth:`reset` cut connections (at least one each).
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self._target = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._pairs: list[tuple[socket.socket, socket.socket]] = []
        self._lock = threading.Lock()
        self._closed = False
        self.resets = 0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def reset(self) -> int:
        """Cut every open connection with a TCP reset; returns how many were cut."""
        with self._lock:
            pairs, self._pairs = self._pairs, []
        for pair in pairs:
            for sock in pair:
                _hard_close(sock)
        if pairs:
            self.resets += 1
        return len(pairs)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        self.reset()

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(self._target)
            except OSError:
                _hard_close(client)
                continue
            with self._lock:
                self._pairs.append((client, upstream))
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=_pump, args=(a, b), name="proxy-pump", daemon=True).start()


def _pump(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(_CHUNK):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        _hard_close(sink)


def _hard_close(sock: socket.socket) -> None:
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # RST, not FIN
    except OSError:
        pass
    sock.close()
