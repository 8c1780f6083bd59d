"""Which process is at the other end of a TCP connection, where the kernel tells:
for a client on this host (loopback, or any address of this host's network
namespace), ``/proc/net/tcp`` and ``tcp6`` list both ends of the connection with the
inode of each end's socket, and ``/proc/<pid>/fd`` shows which process holds the
client's end. grpcio gives a server neither ``SO_PEERCRED`` nor its own address, so
this is how the daemon counts a process's streams together whatever connections it
opens.

The server's end of a connection is the socket of this process whose remote address
is the peer; the client's end is the one whose local address is the peer and whose
remote is the server's end (an ephemeral port may be shared by connections to other
destinations). The client's end is looked for first in the process its request names
(``ClientHost.pid``: one directory of fds), then among the processes of the socket's
owner. A peer on another host, in another network or pid namespace, or of a user
whose fds this daemon may not read, is not found: None.

Cost, per connection: reading the two tables (a line per TCP socket of the
namespace; 10-20 ms on the test VM, most of it the kernel writing them) and this
process's fds, then the fds of the process the client names, or where it names none
(or another) its user's processes' fds (a few ms for 90 processes). A stream opened
on a connection already known costs a look at the fds of the process found for it.
"""

from __future__ import annotations

import ipaddress
import os
import sys
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Endpoint", "PeerProcesses", "parse_endpoint"]

_ESTABLISHED = "01"
_REMEMBERED = 1024  # connections whose process is kept (a connection is asked about once per stream)

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class Endpoint:
    """One end of a TCP connection: an IPv4 address (IPv4-mapped IPv6 ones as
    IPv4) and a port."""

    ip: Address
    port: int


def _plain(ip: Address) -> Address:
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def parse_endpoint(address: str) -> Endpoint | None:
    """``127.0.0.1:5123`` or ``[::1]:5123`` (a gRPC peer without its ``ipv4:``
    prefix, already unquoted); None where it is not an IP address and port."""
    host, _, port = address.rpartition(":")
    try:
        return Endpoint(_plain(ipaddress.ip_address(host.strip("[]"))), int(port))
    except ValueError:
        return None


def _hex_ip(text: str) -> Address:
    """An address as ``/proc/net/tcp*`` writes it: 32-bit words in host byte order."""
    raw = bytes.fromhex(text)
    if sys.byteorder == "little":
        raw = b"".join(raw[k:k + 4][::-1] for k in range(0, len(raw), 4))
    return _plain(ipaddress.ip_address(raw))


def _hex_endpoint(text: str) -> Endpoint:
    ip, _, port = text.partition(":")
    return Endpoint(_hex_ip(ip), int(port, 16))


@dataclass(frozen=True)
class _Socket:
    local: Endpoint
    remote: Endpoint
    uid: int
    inode: int


def _tcp_sockets(proc: Path) -> list[_Socket]:
    """The established TCP sockets of this network namespace."""
    found = []
    for table in ("tcp", "tcp6"):
        try:
            lines = (proc / "net" / table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != _ESTABLISHED:
                continue
            found.append(_Socket(_hex_endpoint(fields[1]), _hex_endpoint(fields[2]), int(fields[7]), int(fields[9])))
    return found


def _socket_inodes(process: Path) -> set[int]:
    """The inodes of the sockets ``process`` (a ``/proc/<pid>`` directory) holds;
    empty where it is gone or its fds may not be read."""
    inodes = set()
    try:
        with os.scandir(process / "fd") as fds:
            for fd in fds:
                try:
                    target = os.readlink(fd.path)
                except OSError:
                    continue
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except OSError:
        pass
    return inodes


def _owned_by(proc: Path, uid: int) -> list[int]:
    """The pids of ``uid``'s processes, lowest first."""
    pids = []
    for entry in os.scandir(proc):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                continue
    return sorted(pids)


class PeerProcesses:
    """Finds the process of a TCP peer on this host (see the module doc). Thread-safe.

    Args:
        proc: where procfs is mounted (a test may point it elsewhere).
    """

    def __init__(self, proc: Path = Path("/proc")) -> None:
        self._proc = proc
        self._known: OrderedDict[Endpoint, tuple[int, int]] = OrderedDict()  # peer -> (inode, pid)
        self._lock = threading.Lock()

    def process_of(self, peer: Endpoint, claimed_pid: int = 0) -> int | None:
        """The pid holding the client's end of this daemon's connection from ``peer``
        (``claimed_pid`` first: what the client says it is), None where the kernel
        does not say (see the module doc)."""
        with self._lock:
            known = self._known.get(peer)
        # A process still holding the socket found before holds the same connection:
        # a connection's address and port are its own while its socket is open.
        if known is not None and known[0] in _socket_inodes(self._proc / str(known[1])):
            return known[1]
        client = self._client_end(peer)
        if client is None:
            return None
        pid = self._holder(client, claimed_pid)
        if pid is not None:
            with self._lock:
                self._known[peer] = (client.inode, pid)
                while len(self._known) > _REMEMBERED:
                    self._known.popitem(last=False)
        return pid

    def _client_end(self, peer: Endpoint) -> _Socket | None:
        sockets = _tcp_sockets(self._proc)
        ours = _socket_inodes(self._proc / "self")
        servers = {s.local for s in sockets if s.remote == peer and s.inode in ours}
        return next((s for s in sockets if s.local == peer and s.remote in servers), None)

    def _holder(self, client: _Socket, claimed_pid: int) -> int | None:
        if claimed_pid > 0 and client.inode in _socket_inodes(self._proc / str(claimed_pid)):
            return claimed_pid
        for pid in _owned_by(self._proc, client.uid):
            if client.inode in _socket_inodes(self._proc / str(pid)):
                return pid
        return None
