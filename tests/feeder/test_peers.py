"""The process at the other end of a TCP connection, as /proc tells: real
connections from this process and from a child, and a procfs written by the test for
the table's formats (IPv6, IPv4-mapped, a shared ephemeral port)."""

from __future__ import annotations

import ipaddress
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from feeder.peers import Endpoint, PeerProcesses, parse_endpoint

_CHILD = """
import socket, sys, time
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
print(s.getsockname()[1], flush=True)
time.sleep(60)
"""


@pytest.fixture()
def listener():
    server = socket.create_server(("127.0.0.1", 0))
    yield server
    server.close()


def _endpoint(address: tuple[str, int]) -> Endpoint:
    return Endpoint(ipaddress.ip_address(address[0]), address[1])


def test_a_connection_from_another_process_is_that_process_whatever_it_claims(listener):
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(listener.getsockname()[1])], stdout=subprocess.PIPE,
                             text=True)
    try:
        conn, address = listener.accept()
        assert int(child.stdout.readline()) == address[1]
        peers = PeerProcesses()
        started = time.perf_counter()
        found = PeerProcesses().process_of(_endpoint(address))  # no claim: its user's processes scanned
        took_s = time.perf_counter() - started
        print(f"a peer's process found by a scan in {took_s * 1e3:.1f} ms")  # with -s
        assert found == child.pid
        assert peers.process_of(_endpoint(address), claimed_pid=os.getpid()) == child.pid  # a false claim
        assert peers.process_of(_endpoint(address), claimed_pid=child.pid) == child.pid
        conn.close()
    finally:
        child.kill()
        child.wait()


def test_a_connection_from_this_process_is_this_process(listener):
    client = socket.create_connection(listener.getsockname())
    conn, address = listener.accept()
    try:
        assert PeerProcesses().process_of(_endpoint(address)) == os.getpid()
    finally:
        client.close()
        conn.close()


def test_a_peer_without_a_connection_here_is_not_found(listener):
    assert PeerProcesses().process_of(Endpoint(ipaddress.ip_address("10.9.8.7"), 4000)) is None


@pytest.mark.parametrize("text,endpoint", [
    ("127.0.0.1:5123", Endpoint(ipaddress.ip_address("127.0.0.1"), 5123)),
    ("[::1]:5123", Endpoint(ipaddress.ip_address("::1"), 5123)),
    ("[::ffff:10.0.0.1]:80", Endpoint(ipaddress.ip_address("10.0.0.1"), 80)),
    ("host.example:80", None),
    ("127.0.0.1", None),
])
def test_an_endpoint_is_an_ip_address_and_a_port(text, endpoint):
    assert parse_endpoint(text) == endpoint


_HEADER = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"


def _line(local: str, remote: str, inode: int, uid: int, state: str = "01") -> str:
    return f"   0: {local} {remote} {state} 00000000:00000000 00:00000000 00000000  {uid}        0 {inode} 1\n"


def _fake_proc(root: Path, tcp: str, tcp6: str, fds: dict[str, list[int]]) -> Path:
    (root / "net").mkdir(parents=True)
    (root / "net" / "tcp").write_text(_HEADER + tcp)
    (root / "net" / "tcp6").write_text(_HEADER + tcp6)
    for process, inodes in fds.items():
        (root / process / "fd").mkdir(parents=True)
        for fd, inode in enumerate(inodes):
            os.symlink(f"socket:[{inode}]", root / process / "fd" / str(fd))
    return root


def _tables(uid: int) -> tuple[str, str]:
    """The daemon (this process, port 50051) and its clients: 4321 holds
    127.0.0.1:40000 -> 50051, and 4444 127.0.0.1:40000 -> another server (9999): the
    same ephemeral port; a connection closing (40002); over tcp6, [::1]:40001 ->
    [::1]:50052 held by 5555, and an IPv4-mapped peer held by 6666."""
    tcp = (_line("0100007F:C351", "0100007F:9C40", 11, uid) + _line("0100007F:9C40", "0100007F:C351", 12, uid)
           + _line("0100007F:9C40", "0100007F:270F", 13, uid)
           + _line("0100007F:9C42", "0100007F:C351", 17, uid, state="06"))
    loop6, mapped = "00000000000000000000000001000000", "0000000000000000FFFF00000100007F"
    tcp6 = (_line(f"{loop6}:C352", f"{loop6}:9C41", 14, uid) + _line(f"{loop6}:9C41", f"{loop6}:C352", 15, uid)
            + _line(f"{mapped}:C353", f"{mapped}:9C43", 18, uid) + _line(f"{mapped}:9C43", f"{mapped}:C353", 19, uid))
    return tcp, tcp6


_FDS = {"self": [11, 14, 18], "4321": [12], "4444": [13], "5555": [15], "6666": [19]}


@pytest.mark.skipif(sys.byteorder != "little", reason="the fake tables are written in little-endian words")
def test_the_tables_formats_are_read_and_a_shared_ephemeral_port_is_told_apart(tmp_path):
    peers = PeerProcesses(_fake_proc(tmp_path, *_tables(os.getuid()), _FDS))  # the fake processes are ours
    assert peers.process_of(parse_endpoint("127.0.0.1:40000")) == 4321
    assert peers.process_of(parse_endpoint("[::1]:40001")) == 5555
    assert peers.process_of(parse_endpoint("127.0.0.1:40003")) == 6666  # IPv4-mapped, seen as IPv4
    assert peers.process_of(parse_endpoint("127.0.0.1:40002")) is None  # not established


@pytest.mark.skipif(sys.byteorder != "little", reason="the fake tables are written in little-endian words")
def test_only_the_sockets_owners_processes_are_scanned_and_a_claim_is_checked(tmp_path):
    peers = PeerProcesses(_fake_proc(tmp_path, *_tables(os.getuid() + 1), _FDS))  # sockets of another user
    assert peers.process_of(parse_endpoint("127.0.0.1:40000")) is None
    assert peers.process_of(parse_endpoint("127.0.0.1:40000"), claimed_pid=4444) is None  # holds another socket
    assert peers.process_of(parse_endpoint("127.0.0.1:40000"), claimed_pid=4321) == 4321


@pytest.mark.skipif(sys.byteorder != "little", reason="the fake tables are written in little-endian words")
def test_a_connection_found_is_kept_while_its_process_holds_it_and_not_after(tmp_path):
    proc = _fake_proc(tmp_path, *_tables(os.getuid()), _FDS)
    peers = PeerProcesses(proc)
    assert peers.process_of(parse_endpoint("127.0.0.1:40000")) == 4321
    (proc / "net" / "tcp").write_text(_HEADER)  # the tables are not read again for it
    assert peers.process_of(parse_endpoint("127.0.0.1:40000")) == 4321
    # It closed, and another process's connection to this daemon got its port.
    os.remove(proc / "4321" / "fd" / "0")
    (proc / "net" / "tcp").write_text(_HEADER + _line("0100007F:C351", "0100007F:9C40", 11, os.getuid())
                                      + _line("0100007F:9C40", "0100007F:C351", 20, os.getuid()))
    (proc / "7777" / "fd").mkdir(parents=True)
    os.symlink("socket:[20]", proc / "7777" / "fd" / "0")
    assert peers.process_of(parse_endpoint("127.0.0.1:40000")) == 7777
