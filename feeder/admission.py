"""Which streams the daemon lets in: at most ``max_streams`` in all, at most
``max_streams_per_peer`` from one client (a process where the daemon can tell, else a
connection: see :func:`client_of`), at most ``max_streams_per_address`` from the
connections of one address whose processes it cannot tell, at most
``max_streams_per_job`` from one job, and only while the estimated memory of every
open stream stays within ``max_memory_bytes``.

The memory of a stream is estimated from its request before anything is built (see
:func:`stream_need_bytes`); the estimate is reserved while the stream is open and
given back when it closes. Idle pipelines kept by the pool for reuse are not part of
any stream's estimate.

A refusal for a shared resource (all streams, all memory, all pipelines) makes the
node *contended* for a while (:meth:`Admission.contended`): the daemon then cancels
streams whose clients have taken nothing for ``contended_idle_timeout_s`` instead of
``idle_timeout_s``, so an unread stream never keeps the resources another client is
asking for.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, replace
from typing import Generic, TypeVar

from core.errors import ResourceExhausted, ServiceUnavailable
from feeder.config import ServerConfig
from feeder.log_lines import clip
from feeder.metrics import ServerMetrics
from feeder.peers import PeerProcesses, parse_endpoint

__all__ = [
    "DECODED_SAMPLE_BYTES", "ENCODED_SAMPLE_BYTES", "Admission", "Client", "Ticket", "client_of", "run_bytes",
    "stream_need_bytes",
]

# One source photo decoded to RGB before it is cropped and resized: 500 x 400 px,
# a little above ImageNet's mean (about 400 x 350), so typical batches fit.
DECODED_SAMPLE_BYTES = 500 * 400 * 3
# One sample's JPEG bytes, as a batch taken ahead of those in flight holds them
# (``--lookahead``): ImageNet's mean file is about 110 KB.
ENCODED_SAMPLE_BYTES = 128 << 10
# Batches a stream holds besides its ready queue: the one its producer waits to
# queue, the one being sent, and that one's serialized copy.
_HELD_BATCHES = 3
_MIB = 1 << 20

Stream = TypeVar("Stream", bound=Hashable)


def stream_need_bytes(config: ServerConfig, batch_size: int, image_size: int) -> int:
    """Estimated peak memory of one stream, in bytes.

    ``batch`` is one output batch (``batch_size x image_size^2 x 3`` bytes, uint8):

    - the ready queue: ``queue_batches`` batches, fewer if ``queue_bytes`` holds fewer
      (never less than one);
    - three more batches held outside the queue (see ``_HELD_BATCHES``);
    - the pipeline's ``prefetch`` runs in flight, each holding per sample one decoded
      source photo (``DECODED_SAMPLE_BYTES``) and two output-sized images (DALI's
      resize and crop/flip output). The CPU window decoder holds instead ``prefetch +
      1`` batches of decoded windows, each at most a photo: at 224 px and the default
      prefetch of 2 the two come to the same bytes (1.80 MB a sample);
    - the batches taken ahead of those (``lookahead``), each holding its samples'
      JPEG bytes (``ENCODED_SAMPLE_BYTES``; its few slow windows decoded early are
      reduced-scale windows, each at most a photo).
    """
    image = image_size * image_size * 3
    batch = batch_size * image
    queued = min(config.budgets.queue_batches, max(1, config.budgets.queue_bytes // batch))
    pipeline = config.tuning.stream_prefetch * run_bytes(batch_size, image_size)
    ahead = config.tuning.lookahead * batch_size * ENCODED_SAMPLE_BYTES
    return (queued + _HELD_BATCHES) * batch + pipeline + ahead


def run_bytes(batch_size: int, image_size: int) -> int:
    """What one pipeline run in flight holds (see :func:`stream_need_bytes`)."""
    return batch_size * (DECODED_SAMPLE_BYTES + 2 * image_size * image_size * 3)


@dataclass(frozen=True)
class Client:
    """Who a stream's client is, for the per-client limit and the shares.

    Attributes:
        key: the process where the daemon can tell: ``pid=1234`` (a TCP peer on
            this host, as the kernel says) or ``unix:pid=1234`` (over the unix
            socket, the pid its request names; ``unix`` without one); else the
            connection, ``ipv4:10.0.0.1:5123``; ``local`` for a caller without gRPC.
        address: for a connection whose process the daemon cannot tell, its
            address (``ipv4:10.0.0.1``), for ``max_streams_per_address``; else "".
    """

    key: str
    address: str = ""


def client_of(peer: str, pid: int = 0, processes: PeerProcesses | None = None) -> Client:
    """The client of a stream from gRPC peer ``peer`` (``context.peer()``) whose
    request names process ``pid`` (0: none): over TCP the process holding the
    connection where ``processes`` finds it (the channels of one process may open
    several connections), else the connection; over the unix socket, where every
    peer looks alike, the process the request names (the socket is owner-only, so
    that is one user's word). ``""`` (a caller without gRPC) is ``local``."""
    if not peer:
        return Client("local")
    kind, _, address = peer.partition(":")
    if kind == "unix":
        return Client(f"unix:pid={pid}" if pid else "unix")
    address = urllib.parse.unquote(address)
    endpoint = parse_endpoint(address)
    if endpoint is None:
        host, _, port = address.rpartition(":")
        return Client(f"{kind}:{host}:{port}", f"{kind}:{host}")
    found = processes.process_of(endpoint, pid) if processes is not None else None
    if found is not None:
        return Client(f"pid={found}")
    host = str(endpoint.ip) if endpoint.ip.version == 4 else f"[{endpoint.ip}]"
    return Client(f"ipv{endpoint.ip.version}:{host}:{endpoint.port}", f"ipv{endpoint.ip.version}:{host}")


@dataclass(frozen=True)
class Ticket:
    """What an admitted stream holds.

    Attributes:
        name: how the log names the stream.
        client: its client (:func:`client_of`).
        job: its job (the request's ``job_id``; its client when it names none).
        need_bytes: its reserved memory estimate.
        cancel: ends the stream's call from the daemon's side (idle timeout).
        run_bytes: what each of its pipeline runs in flight holds, in
            ``need_bytes`` (see :meth:`Admission.set_runs`).
    """

    name: str
    client: Client
    job: str
    need_bytes: int
    cancel: Callable[[], None]
    run_bytes: int = 0


class Admission(Generic[Stream]):
    """The open streams and the budgets they are admitted against. Thread-safe.

    Args:
        config: the limits (``max_streams``, ``max_streams_per_peer``,
            ``max_streams_per_address``, ``max_streams_per_job``, ``max_memory_bytes``) and how long a refusal
            keeps the node contended (``contended_idle_timeout_s``).
        metrics: where refusals and reserved bytes are counted.
    """

    def __init__(self, config: ServerConfig, metrics: ServerMetrics) -> None:
        self._config = config
        self._metrics = metrics
        self._open: dict[Stream, Ticket] = {}
        self._per_client: Counter[str] = Counter()
        self._per_address: Counter[str] = Counter()  # of clients known only by their connection
        self._per_job: Counter[str] = Counter()
        self._reserved_bytes = 0
        self._accepting = True
        self._refused_s: float | None = None  # when a shared resource last ran out
        self._lock = threading.Lock()
        metrics.memory_budget_set(config.budgets.max_memory_bytes)

    def check(self, client: Client, job: str, need_bytes: int) -> None:
        """Raise what :meth:`admit` would raise now (to refuse before building)."""
        with self._lock:
            self._refuse_if_over(client, job, need_bytes)

    def admit(self, stream: Stream, ticket: Ticket) -> None:
        """Register ``stream``.

        Raises:
            ServiceUnavailable: shutting down.
            ResourceExhausted: ``max_streams``, its client's, address's or job's
                limit, or the memory budget would be passed (the message names the
                limit).
        """
        with self._lock:
            self._refuse_if_over(ticket.client, ticket.job, ticket.need_bytes)
            self._open[stream] = ticket
            self._per_client[ticket.client.key] += 1
            self._per_address[ticket.client.address] += 1
            self._per_job[ticket.job] += 1
            self._reserved_bytes += ticket.need_bytes
            self._metrics.memory_reserved(self._reserved_bytes)

    def release(self, stream: Stream) -> Ticket | None:
        """Forget ``stream`` and give back what it reserved; its ticket, if it had one."""
        with self._lock:
            ticket = self._open.pop(stream, None)
            if ticket is not None:
                self._per_client -= Counter({ticket.client.key: 1})
                self._per_address -= Counter({ticket.client.address: 1})
                self._per_job -= Counter({ticket.job: 1})
                self._reserved_bytes -= ticket.need_bytes
                self._metrics.memory_reserved(self._reserved_bytes)
            return ticket

    def set_runs(self, stream: Stream, change: int) -> bool:
        """Reserve (or give back) what ``change`` more pipeline runs in flight of
        ``stream`` hold; False where the memory budget has no room (nothing changes)."""
        with self._lock:
            ticket = self._open.get(stream)
            if ticket is None:
                return False
            extra = change * ticket.run_bytes
            if extra > 0 and self._reserved_bytes + extra > self._config.budgets.max_memory_bytes:
                return False
            self._open[stream] = replace(ticket, need_bytes=ticket.need_bytes + extra)
            self._reserved_bytes += extra
            self._metrics.memory_reserved(self._reserved_bytes)
            return True

    def ran_out(self, reason: str) -> None:
        """A stream was refused because a resource every client shares ran out
        (``reason``: the limit, as counted in ``feeder_streams_refused_total``)."""
        self._metrics.stream_refused(reason)
        with self._lock:
            self._refused_s = time.monotonic()

    def contended(self) -> bool:
        """Whether a client was refused a shared resource lately: within twice
        ``contended_idle_timeout_s`` (a refused loader asks again within that)."""
        with self._lock:
            refused = self._refused_s
        return refused is not None and time.monotonic() - refused < 2 * self._config.budgets.contended_idle_timeout_s

    def stop_accepting(self) -> None:
        """Refuse every stream from now on (shutdown)."""
        with self._lock:
            self._accepting = False

    def open(self) -> list[tuple[Stream, Ticket]]:
        """The open streams and their tickets, now."""
        with self._lock:
            return list(self._open.items())

    def __len__(self) -> int:
        with self._lock:
            return len(self._open)

    def _refuse_if_over(self, client: Client, job: str, need_bytes: int) -> None:
        config = self._config
        if not self._accepting:
            raise ServiceUnavailable("daemon is shutting down")
        if self._per_client[client.key] >= config.budgets.max_streams_per_peer:
            self._metrics.stream_refused("max_streams_per_peer")
            count = self._per_client[client.key]
            raise ResourceExhausted(f"max_streams_per_peer: {clip(client.key)} already has {count} streams open "
                                    f"(limit {config.budgets.max_streams_per_peer})")
        if client.address and self._per_address[client.address] >= config.budgets.max_streams_per_address:
            self._metrics.stream_refused("max_streams_per_address")
            raise ResourceExhausted(f"max_streams_per_address: the connections of {clip(client.address)} already "
                                    f"have {self._per_address[client.address]} streams open (limit "
                                    f"{config.budgets.max_streams_per_address}; their processes are not known here)")
        if self._per_job[job] >= config.budgets.max_streams_per_job:
            self._metrics.stream_refused("max_streams_per_job")
            raise ResourceExhausted(f"max_streams_per_job: job {clip(job)} already has {self._per_job[job]} streams "
                                    f"open (limit {config.budgets.max_streams_per_job})")
        if len(self._open) >= config.budgets.max_streams:
            self._ran_out_locked("max_streams")
            raise ResourceExhausted(f"max_streams: {config.budgets.max_streams} streams already open")
        if self._reserved_bytes + need_bytes > config.budgets.max_memory_bytes:
            self._ran_out_locked("max_memory")
            raise ResourceExhausted(
                f"max_memory: this stream needs {need_bytes / _MIB:.1f} MiB; {len(self._open)} open streams "
                f"hold {self._reserved_bytes / _MIB:.1f} MiB of the {config.budgets.max_memory_bytes / _MIB:.1f} MiB "
                "budget"
            )

    def _ran_out_locked(self, reason: str) -> None:
        self._metrics.stream_refused(reason)
        self._refused_s = time.monotonic()

