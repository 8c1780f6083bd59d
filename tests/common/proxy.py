"""A TCP forwarder in front of a server (a daemon, an object store), for fault tests:
connections it resets (as a load balancer or a proxy restart does: the client's calls
fail and it connects again), connections it freezes (bytes stop flowing both ways:
requests hang until their timeout)."""

from __future__ import annotations

import socket
import struct
import threading
from types import TracebackType

__all__ = ["TcpProxy"]


class TcpProxy:
    """Forwards ``127.0.0.1:<port>`` to ``upstream``; a context manager.

    Args:
        upstream: ``host:port`` of the real server.

    Attributes:
        address: ``127.0.0.1:<port>``, where clients connect.
        url: ``http://`` + ``address`` (the endpoint of a store client).
        resets: how many times :meth:`reset_open` cut at least one connection.
    """

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self._upstream = (host, int(port))
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self.url = f"http://{self.address}"
        self._flowing = threading.Event()
        self._flowing.set()
        self._to_reset = 0
        self._lock = threading.Lock()
        self._closed = False
        self._sockets: list[socket.socket] = []
        self.resets = 0
        threading.Thread(target=self._accept, name="proxy-accept", daemon=True).start()

    def freeze(self) -> None:
        self._flowing.clear()

    def thaw(self) -> None:
        self._flowing.set()

    def reset_open(self) -> int:
        """Reset every open connection now; returns how many pairs were cut."""
        with self._lock:
            sockets, self._sockets = self._sockets, []
        for sock in sockets:
            _reset(sock)
        if sockets:
            self.resets += 1
        return len(sockets) // 2

    def reset_next(self, connections: int) -> None:
        """The next ``connections`` connections are reset as soon as they are accepted,
        and every open one now."""
        with self._lock:
            self._to_reset += connections
        self.reset_open()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                reset, self._to_reset = self._to_reset > 0, max(0, self._to_reset - 1)
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
                threading.Thread(target=self._pump, args=(source, target), name="proxy-pump", daemon=True).start()

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
        self.reset_open()

    def __enter__(self) -> TcpProxy:
        return self

    def __exit__(self, kind: type[BaseException] | None, error: BaseException | None,
                 trace: TracebackType | None) -> None:
        self.close()


def _reset(sock: socket.socket) -> None:
    """Close ``sock`` with a TCP reset (linger 0), as a crashed peer does."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        sock.close()
    except OSError:
        pass
