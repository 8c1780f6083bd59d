"""The loader's streams and its connection: which stream delivers the next batch.

One stream runs across epochs while the sizes stay the same; a stream is opened
ahead of a planned size change (the *successor*) as soon as the current one has
received its last batch; the first batch of the next epoch, taken while looking for
the end of the current one, is kept for the next pass (*pending*). :class:`Streams`
holds no reference to its loader, so a finalizer of the loader can own it.
"""

from __future__ import annotations

from typing import NamedTuple

import grpc

from clients.channel import open_channel, resolve_token
from clients.fetcher import HostBatch, StreamFetcher, error_from_rpc
from clients.loader_config import LoaderConfig
from clients.spec import Sizes, SplitInfo, StreamSpecs
from core.errors import NotFound, ServiceUnavailable
from protocol.request import MAX_EPOCH, to_request
from protos import feeder_pb2, feeder_pb2_grpc
from transport.base import TransportKind
from transport.client import STREAM_BATCHES, SlotReleaser

__all__ = ["Connection", "Streams"]

# A 256 x 288 x 288 x 3 batch is 64 MB; gRPC's 4 MB default would refuse it.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                    ("grpc.max_send_message_length", -1)]
# Epochs one stream runs on for when no size change is planned: the daemon plans each
# epoch only when it gets there, so a long stream costs nothing up front.
_EPOCHS_PER_STREAM = 1000


class Connection:
    """The channel to the daemon and the calls made on it.

    Args:
        config: The address, token and TLS files to connect with.

    Raises:
        ConfigError: a TLS file cannot be read, or ``FEEDER_TOKEN`` is not a token.
    """

    def __init__(self, config: LoaderConfig) -> None:
        self.address = config.address
        self.channel = open_channel(config.address, _CHANNEL_OPTIONS, resolve_token(config.token),
                                    config.tls_root, config.tls_cert, config.tls_key)
        self.stub = feeder_pb2_grpc.FeederStub(self.channel)
        # Batches arrive as the bytes sent: the transport's receiver parses them.
        self.stream_batches = self.channel.unary_stream(
            STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        self.releaser = SlotReleaser(self.stub.ReleaseSlots)

    def describe(self, dataset: str, split: str, timeout_s: float) -> SplitInfo:
        """What the daemon serves as ``dataset``/``split``, and its limits.

        Raises:
            ServiceUnavailable: no answer within ``timeout_s``.
            NotFound: the daemon does not serve that dataset or split.
            FeederError: the daemon refused the call (e.g. ``Unauthenticated``).
        """
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            reply = self.stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            raise ServiceUnavailable(f"daemon {self.address} not reachable within {timeout_s:.0f} s") from e
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from e
        info = next((d for d in reply.datasets if d.name == dataset), None)
        if info is None:
            names = [d.name for d in reply.datasets]
            raise NotFound(f"daemon {self.address} does not serve dataset {dataset!r} (it serves {names})")
        found = next((s for s in info.splits if s.name == split), None)
        if found is None:
            names = [s.name for s in info.splits]
            raise NotFound(f"daemon {self.address}: dataset {dataset!r} has no split {split!r} (splits: {names})")
        return SplitInfo(found.num_samples, list(info.classes), reply.max_batch_size)

    def close(self) -> None:
        """Stops handing slots back and closes the channel."""
        self.releaser.close()
        self.channel.close()


class OpenStream(NamedTuple):
    """A stream and the sizes it was opened with."""

    fetcher: StreamFetcher
    sizes: Sizes


class Streams:
    """The stream that delivers a loader's next batch, and the ones kept ready.

    Args:
        connection: The channel the streams are opened on (closed by :meth:`release`).
        specs: What each stream asks for.
        config: Prefetch depth, timeouts, transport and shm directory.
        client_host: This process's host (and GPU), sent with each request.
        pin: Put host batches in pinned memory (a CUDA consumer).
    """

    def __init__(self, connection: Connection, specs: StreamSpecs, config: LoaderConfig,
                 client_host: feeder_pb2.ClientHost, pin: bool) -> None:
        self.connection = connection
        self._specs, self._config, self._client_host, self._pin = specs, config, client_host, pin
        self.current: OpenStream | None = None
        self.successor: OpenStream | None = None  # opened ahead of a planned size change
        self.pending: HostBatch | None = None  # first batch of the next epoch, already taken
        self.planned: dict[int, Sizes] = {}  # epoch -> sizes from then on
        self._closed_reconnects = 0
        self._last_transport = ""
        # What new streams ask for: the configured transport, or the one a stream fell
        # back to because this process cannot use it (asked for once, warned once).
        self._transport = config.transport_kind

    @property
    def transport(self) -> str:
        """What carried the last batch (empty before the first)."""
        current = self.current.fetcher.transport if self.current is not None else ""
        return current or self._last_transport

    @property
    def reconnects(self) -> int:
        """Times a stream was reopened after a transient failure, closed streams included."""
        current = self.current.fetcher.reconnects if self.current is not None else 0
        return self._closed_reconnects + current

    def next_batch(self, epoch: int, cursor: int, sizes: Sizes) -> HostBatch | None:
        """The next batch of ``epoch`` (the consumer is at ``cursor``) at ``sizes``, or
        None when the streams have no more of it (the next epoch's first batch is then
        kept for the next pass).

        Raises:
            FeederError: what ended the stream (see :meth:`StreamFetcher.get`).
        """
        host: HostBatch | None
        if self.pending is not None:
            host, self.pending = self.pending, None
        else:
            fetcher = self._fetcher_here(epoch, cursor, sizes)
            host = fetcher.get()
            self._open_successor(fetcher)
        if host is not None and host.meta.epoch != epoch:
            self.pending = host
            return None
        return host

    def epoch_ended(self, next_epoch: int, sizes: Sizes) -> None:
        """The consumer has drained an epoch: make sure ``next_epoch`` is streaming
        (or, without ``prefetch_next_epoch``, close everything)."""
        if not self._config.prefetch_next_epoch:
            self.drop()
        elif self.current is None or self.current.fetcher.end_epoch <= next_epoch:
            if self.successor is None:  # nothing streams the next epoch yet: open it now
                self.drop()
                self.current = self._start(next_epoch, 0, sizes)

    def _fetcher_here(self, epoch: int, cursor: int, sizes: Sizes) -> StreamFetcher:
        """The stream that delivers the next batch at ``(epoch, cursor)`` and ``sizes``:
        the open one, else the one opened ahead, else a new one."""
        if self.current is not None and self.current.sizes == sizes:
            return self.current.fetcher
        successor = self.successor
        if successor is not None and successor.sizes == sizes and \
                (successor.fetcher.request.epoch, successor.fetcher.request.start_cursor) == (epoch, cursor):
            self.successor = None
            self.drop()
            self.current = successor
        else:
            self.drop()
            self.current = self._start(epoch, cursor, sizes)
        return self.current.fetcher

    def _open_successor(self, fetcher: StreamFetcher) -> None:
        """Once ``fetcher`` has received its stream's last batch (the daemon's side is
        done; the consumer still has the queued ones to drain), open the planned next."""
        planned = self.planned.get(fetcher.end_epoch)
        if planned is None or self.successor is not None or self.current is None or \
                self.current.fetcher is not fetcher:
            return
        received_all = fetcher.finished.is_set() or (
            fetcher.epoch == fetcher.end_epoch - 1
            and self._specs.batches_after(fetcher.cursor, fetcher.request.batch_size) == 0)
        if received_all:
            self.successor = self._start(fetcher.end_epoch, 0, planned)

    def _start(self, epoch: int, cursor: int, sizes: Sizes) -> OpenStream:
        """A stream from (epoch, cursor) at ``sizes``, running on across epochs until the
        next planned size change (one epoch without ``prefetch_next_epoch``).

        Raises:
            ConfigError: a request the daemon would refuse (an epoch out of range).
        """
        config = self._config
        if config.prefetch_next_epoch:
            end = min([e for e in self.planned if e > epoch], default=epoch + _EPOCHS_PER_STREAM)
        else:
            end = epoch + 1
        spec = self._specs.spec(epoch, cursor, sizes, epochs=min(end, MAX_EPOCH + 1) - epoch)
        request = to_request(spec)
        request.transport = self._usable_transport().value
        request.client_host.CopyFrom(self._client_host)
        conn = self.connection
        fetcher = StreamFetcher(conn.stream_batches, request, conn.address, config.prefetch_batches,
                                config.reconnect_timeout_s, pin=self._pin, stall_timeout_s=config.stall_timeout_s,
                                release=conn.releaser, shm_dir=config.shm_dir)
        return OpenStream(fetcher, sizes)

    def _usable_transport(self) -> TransportKind:
        """The transport new streams ask for: a fetcher changes its request only to
        fall back, so one that differs is what works here."""
        for stream in (self.current, self.successor):
            if stream is not None and stream.fetcher.request.transport != self._transport.value:
                self._transport = TransportKind(stream.fetcher.request.transport)
        return self._transport

    def drop(self) -> None:
        """Close the open stream and any opened ahead; forget a taken-ahead batch."""
        self._usable_transport()
        for stream in (self.current, self.successor):
            if stream is not None:
                self._last_transport = stream.fetcher.transport or self._last_transport
                self._closed_reconnects += stream.fetcher.reconnects
                stream.fetcher.close()
        self.current = self.successor = None
        self.pending = None

    def release(self) -> None:
        """Ends the streams (their threads and the daemon's side) and closes the
        channel: what a loader gives back however it ends."""
        self.drop()
        self.connection.close()
