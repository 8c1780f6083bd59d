"""The loader's streams: which stream delivers the next batch.

One stream runs across epochs while the sizes stay the same; a stream is opened
ahead of a planned size change (the *successor*) as soon as the current one has
received its last batch; the first batch of the next epoch, taken while looking for
the end of the current one, is kept for the next pass (*pending*). :class:`Streams`
holds no reference to its loader, so a finalizer of the loader can own it.
"""

from __future__ import annotations

from typing import NamedTuple

from prometheus_client import Gauge

from clients.config import LoaderConfig
from clients.failover import Failover
from clients.host_batch import HostBatch, PinnedFields
from clients.pool import DaemonPool
from clients.ranks import local_world_size
from clients.spec import Sizes, StreamSpecs
from core.errors import ConfigError, NotFound
from protocol.request import MAX_EPOCH, ClientHost
from transport.base import TransportKind

__all__ = ["DAEMONS_IN_USE", "Streams", "checked_specs"]

# In the process's default registry: a training script's own Prometheus endpoint shows it.
DAEMONS_IN_USE = Gauge("feeder_loader_daemons_in_use", "Daemons a FeederLoader draws its batches from now.",
                       ["dataset", "split", "rank"])

# Epochs one stream runs on for when no size change is planned: the daemon plans each
# epoch only when it gets there, so a long stream costs nothing up front.
_EPOCHS_PER_STREAM = 1000


def checked_specs(pool: DaemonPool, config: LoaderConfig, rank: int, world_size: int,
                  client_host: ClientHost) -> StreamSpecs:
    """The loader's requests from this process's ``client_host``, checked against the
    daemons' answer to ``ListDatasets`` (a mix's epoch length: the configured one,
    else its datasets' samples together); closes ``pool`` if that fails.

    Raises:
        ConfigError: a request the daemons would refuse; a dataset of a mix (or its
            split) that no daemon serves.
    """
    try:
        try:
            served = pool.describe(config.connect_timeout_s)
        except NotFound as e:
            if not config.mix:
                raise
            raise ConfigError(f"dataset: {e}") from e
        length = (config.epoch_samples or served.num_samples) if config.mix else None
        base = config.stream_spec(rank, world_size, local_world_size(world_size), length, client_host)
        return StreamSpecs(base, served)
    except BaseException:
        pool.close()
        raise



class OpenStream(NamedTuple):
    """A stream and the sizes it was opened with."""

    fetcher: Failover
    sizes: Sizes


class Streams:
    """The stream that delivers a loader's next batch, and the ones kept ready.

    Args:
        pool: The daemons the streams are opened on (closed by :meth:`release`): one
            daemon's stream where there is one, else a stream drawn from all of them.
        specs: What each stream asks for (this process's host, transport and
            prefetch depth included).
        config: Prefetch depth, timeouts and shm directory.
        pin: Where host batches are pinned (a CUDA consumer; None: not pinned).
    """

    def __init__(self, pool: DaemonPool, specs: StreamSpecs, config: LoaderConfig,
                 pin: PinnedFields | None) -> None:
        self.pool = pool
        self._specs, self._config, self._pin = specs, config, pin
        self.current: OpenStream | None = None
        self.successor: OpenStream | None = None  # opened ahead of a planned size change
        self.pending: HostBatch | None = None  # first batch of the next epoch, already taken
        self.planned: dict[int, Sizes] = {}  # epoch -> sizes from then on
        self._closed_reconnects = 0
        self._last_transport = ""
        self._in_use = 0  # daemons the last closed stream drew from (``as-needed`` starts there)
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
            FeederError: what ended the stream (see :meth:`Failover.get`).
        """
        host: HostBatch | None
        if self.pending is not None:
            host, self.pending = self.pending, None
        else:
            fetcher = self._fetcher_here(epoch, cursor, sizes)
            host = fetcher.get()
            self._open_successor(fetcher)
        if host is not None and host.meta.epoch < epoch:  # the end of an epoch the consumer has left: repeats
            host.release(None)  # only, of a "partial" loader's last batch
            return self.next_batch(epoch, cursor, sizes)
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

    @property
    def daemons_in_use(self) -> int:
        """Daemons the current stream draws from (0 before the first)."""
        return self.current.fetcher.daemons_in_use if self.current is not None else 0

    def report_daemons(self, dataset: str, split: str, rank: int) -> None:
        """Keep the gauge of daemons in use (Prometheus' default registry) current."""
        DAEMONS_IN_USE.labels(dataset=dataset, split=split, rank=str(rank)).set(self.daemons_in_use)

    def _fetcher_here(self, epoch: int, cursor: int, sizes: Sizes) -> Failover:
        """The stream that delivers the next batch at ``(epoch, cursor)`` and ``sizes``:
        the open one, else the one opened ahead, else a new one."""
        if self.current is not None and self.current.sizes == sizes and self.current.fetcher.end_epoch > epoch:
            return self.current.fetcher
        successor = self.successor
        if successor is not None and successor.sizes == sizes and \
                (successor.fetcher.spec.epoch, successor.fetcher.spec.start_cursor) == (epoch, cursor):
            self.successor = None
            self.drop()
            self.current = successor
        else:
            self.drop()
            self.current = self._start(epoch, cursor, sizes)
        return self.current.fetcher

    def _open_successor(self, fetcher: Failover) -> None:
        """Once ``fetcher`` has received its stream's last batch (the daemon's side is
        done; the consumer still has the queued ones to drain), open the planned next."""
        planned = self.planned.get(fetcher.end_epoch)
        if planned is None and self._config.max_batches_per_epoch and self.current is not None:
            planned = self.current.sizes  # each cut epoch has a stream of its own: open the next ahead
        if planned is None or self.successor is not None or self.current is None or \
                self.current.fetcher is not fetcher:
            return
        if fetcher.finished.is_set() or fetcher.received_all:
            self.successor = self._start(fetcher.end_epoch, 0, planned)

    def _start(self, epoch: int, cursor: int, sizes: Sizes) -> OpenStream:
        """A stream from (epoch, cursor) at ``sizes``, running on across epochs until the
        next planned size change (one epoch without ``prefetch_next_epoch``).

        Raises:
            ConfigError: a request the daemon would refuse (an epoch out of range).
        """
        config = self._config
        cut = config.max_batches_per_epoch * sizes.batch_size  # samples of each epoch asked for (0: all)
        if config.prefetch_next_epoch and not cut:
            end = min([e for e in self.planned if e > epoch], default=epoch + _EPOCHS_PER_STREAM)
        else:
            end = epoch + 1
        spec = self._specs.spec(epoch, cursor, sizes, epochs=min(end, MAX_EPOCH + 1) - epoch,
                                consumed=self._specs.consumed.get(epoch, ()), max_samples=max(0, cut - cursor),
                                transport=self._usable_transport().value)
        failover = Failover(self.pool, spec, self._specs.window(spec), config, self._pin, daemons=self._in_use)
        return OpenStream(failover, sizes)

    def _usable_transport(self) -> TransportKind:
        """The transport new streams ask for: a fetcher changes its spec's only to
        fall back, so one that differs is what works here."""
        for stream in (self.current, self.successor):
            if stream is not None and stream.fetcher.spec.transport != self._transport.value:
                self._transport = TransportKind(stream.fetcher.spec.transport)
        return self._transport

    def drop(self) -> None:
        """Close the open stream and any opened ahead; forget a taken-ahead batch."""
        self._usable_transport()
        for stream in (self.current, self.successor):
            if stream is not None:
                self._last_transport = stream.fetcher.transport or self._last_transport
                self._closed_reconnects += stream.fetcher.reconnects
                self._in_use = stream.fetcher.daemons_in_use or self._in_use
                stream.fetcher.close()
        self.current = self.successor = None
        self.pending = None

    def release(self) -> None:
        """Ends the streams (their threads and the daemons' side) and closes the
        channels: what a loader gives back however it ends."""
        self.drop()
        self.pool.close()
