"""The daemon's logic without gRPC: named datasets, request checks, the plan, and the
open streams, over the parts :func:`feeder.assembly.assemble` builds. The servicer
only converts messages."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

from core.bad_input import OnError
from core.errors import InvalidArgument
from feeder.admission import Ticket, client_of, run_bytes, stream_need_bytes
from feeder.assembly import ServiceParts, assemble
from feeder.bad_samples import FailureLimits, SampleFilter
from feeder.config import ServerConfig
from feeder.log_lines import clip
from feeder.metrics import ServerMetrics
from feeder.producer import StreamContext
from feeder.remote import close_remote
from feeder.shares import Member
from feeder.stream import BatchStream, StreamOutcome
from feeder.stream_source import find_source
from protocol.mix import Mix, check_epoch_length
from protocol.plan import BatchSlice, RankPart, check_epochs_hold_batches, validate_window
from protocol.request import StreamSpec
from protocol.stream_plan import Skipped, plan_stream, rank_part_of
from shards.ranged import RemoteAccess
from shards.reader import ShardDataset
from transport.base import TransportKind
from transport.daemon import TransportRequest

log = logging.getLogger(__name__)

__all__ = ["FeederService", "open_datasets"]


def open_datasets(paths: Mapping[str, Path | str], remote: RemoteAccess | None = None,
                  allowed_links: tuple[Path, ...] = ()) -> dict[str, ShardDataset]:
    """Open and check every configured dataset (raises on the first bad one): local
    paths, and object store URLs read through ``remote`` (see
    :func:`feeder.remote.remote_access`; its defaults where None). ``allowed_links``:
    directories outside a local root its tars' links may lead to."""
    return {name: ShardDataset.open(name, root if isinstance(root, str) else Path(root), remote=remote,
                                    allowed_links=allowed_links)
            for name, root in paths.items()}


# A stream read in this process (benchmarks, tests): its batches stay in the daemon's
# memory, in buffers the gRPC payload would also use.
_IN_PROCESS = TransportRequest(preference=TransportKind.GRPC)


class FeederService:
    """Serves batches of named datasets.

    Args:
        config: daemon configuration.
        datasets: opened datasets by name (see :func:`open_datasets`).
        metrics: counters to update.
        remote: how the remote datasets are read (their counters and shard cache are
            reported in ``metrics``; the cache is closed with the service).
    """

    def __init__(
        self, config: ServerConfig, datasets: dict[str, ShardDataset], metrics: ServerMetrics,
        remote: RemoteAccess | None = None,
    ) -> None:
        self.config = config
        self.datasets = datasets
        self.metrics = metrics
        self.remote = remote
        if remote is not None:
            metrics.watch_remote(remote.counters, remote.cache)
        self.parts: ServiceParts = assemble(config, datasets, metrics)
        self._numbers = itertools.count(1)

    @property
    def device(self) -> str:
        """``cpu`` or ``gpu``: ``--device`` as resolved on this machine."""
        return self.parts.device

    def open_stream(
        self, spec: StreamSpec, peer: str = "", cancel: Callable[[], None] = lambda: None,
        transport: TransportRequest = _IN_PROCESS,
    ) -> BatchStream:
        """Check ``spec`` against the daemon and its dataset, admit it against the
        daemon's limits, plan its batches and start a producer.

        Args:
            spec: the request (checked on its own already: see
                :class:`protocol.request.StreamSpec`).
            peer: the client's address (``context.peer()``; "" for a caller without
                gRPC), for the per-peer limit and the log.
            cancel: ends the client's call; used when the daemon ends the stream on
                its own (idle timeout).
            transport: what the client asked for and where it runs (shared memory
                for a client on this host, else the gRPC payload).

        Raises:
            NotFound: unknown dataset or split (of any dataset of a mix).
            IdentityMismatch: the request expects another manifest, index or pixel
                options (of any dataset of a mix; FAILED_PRECONDITION).
            InvalidArgument: a batch larger than ``max_batch_size``, a mix's epoch
                longer than ``max_epoch_samples`` (and than its datasets together), a
                cursor past the rank's part.
            ServiceUnavailable: shutting down.
            ResourceExhausted: ``max_streams`` already open, ``max_pipelines`` all lent
                to open streams, its client's or job's stream limit or the memory
                budget reached (the message names which).
            FeederError: DALI could not build the pipeline.
        """
        parts = self.parts
        source = find_source(spec, self.datasets, parts.bad, self.config.pixel_options)
        if spec.batch_size > self.config.budgets.max_batch_size:
            raise InvalidArgument(f"batch_size: {spec.batch_size} is not in 1..{self.config.budgets.max_batch_size}")
        if isinstance(source.plan, Mix):  # before its first epoch's order is built
            check_epoch_length(spec.epoch_samples, self.config.budgets.max_epoch_samples, sum(source.plan.sizes))
        part = rank_part_of(spec, source.plan, spec.epoch)
        validate_window(len(part), spec.start_cursor, spec.max_samples)
        check_epochs_hold_batches(len(source.plan) if isinstance(source.plan, Mix) else source.plan,
                                  spec.world_size, spec.rank, spec.batch_size, spec.last_batch,
                                  f"{clip(spec.dataset)}/{clip(spec.split)}")
        client = client_of(peer, transport.client.pid if transport.client is not None else 0, parts.peers)
        job, need = spec.job_id or client.key, stream_need_bytes(self.config, spec.batch_size, spec.image_size)
        parts.admission.check(client, job, need)  # before building anything for a refused stream
        number = next(self._numbers)
        process = f" {clip(client.key)}" if client.key.startswith("pid=") else ""
        name = f"stream {number} ({clip(peer or 'local')}{process}, job {clip(spec.job_id or '-')})"
        with parts.pipelines.opening(), ExitStack() as held:
            placement = parts.devices.place(transport.gpu_uuid)
            runner = parts.pipelines.lend(parts.pipelines.spec_for(spec, placement), held)
            # On the client's own GPU the batches can stay there (CUDA IPC).
            sender = parts.transports.open_sender(transport, spec.batch_bytes, batch_gpu_uuid=placement.gpu_uuid,
                                                 slots=self.config.stream_ring_slots(transport.prefetch_batches))
            held.callback(parts.transports.close_sender, sender)
            decoding, budgets = self.config.decoding, self.config.budgets
            limits = FailureLimits(decoding.max_failed_batch_fraction, decoding.max_failed_epoch_fraction,
                                   len(part), source.part_lengths(part))
            context = StreamContext(
                source.split, parts.pipelines.cached(runner, spec.dataset, source.split), spec.image_size, len(part),
                SampleFilter(source.bad, OnError(decoding.on_error), limits),
                budgets.queue_batches, budgets.queue_bytes, kind=spec.kind, seed=spec.seed, crop=spec.crop,
                jitter=self.config.jitter,
            )
            stream = BatchStream(context, sender, self._slices(spec, source.plan, part), self.metrics, str(number))
            parts.admission.admit(stream, Ticket(name, client, job, need, cancel,
                                                 run_bytes(spec.batch_size, spec.image_size)))
            held.callback(self._ended, stream)
            parts.shares.join(stream, Member(runner.lane, job, client.key))
            held.callback(parts.shares.leave, stream)
            parts.usage.opened(stream, job)
            self.metrics.stream_opened()
            stream.own(held.pop_all())
        log.info("%s opened: %s/%s rank %d/%d, batch %d, %d px, %d samples from cursor %d, epochs %d-%d, over %s, "
                 "on %s with %d threads", name, spec.dataset, spec.split, spec.rank, spec.world_size, spec.batch_size,
                 spec.image_size, len(part), spec.start_cursor, spec.epoch, spec.epoch + spec.epochs - 1,
                 sender.kind.name.lower(), _where(runner.spec.device, runner.spec.device_id), runner.spec.threads)
        return stream.start()

    def _slices(self, spec: StreamSpec, plan: int | Mix, first: RankPart) -> Iterator[BatchSlice]:
        """The stream's batches, as :func:`protocol.stream_plan.plan_stream` cuts them
        (every ``batch_stride``-th from ``batch_offset``: a rank's share of a pool of
        daemons; ``first``: the rank's part of the first epoch); what ``drop`` skips
        is counted on the way (the left-over of the split among the ranks by the
        job's rank 0 alone)."""
        for step in plan_stream(spec, plan, first):
            if isinstance(step, Skipped):
                self.metrics.samples_skipped(step.tail + (step.left_over if spec.rank == 0 else 0))
            else:
                yield step

    def _ended(self, stream: BatchStream) -> None:
        """A stream's last part to go: its admission, and the line that says how it ended."""
        ticket = self.parts.admission.release(stream)
        failed = stream.outcome in (StreamOutcome.FAILED, StreamOutcome.IDLE)
        detail = f": {stream.detail}" if stream.detail else ""
        log.log(logging.WARNING if failed else logging.INFO, "%s closed, %s%s: %d samples in %d batches, %.1f s",
                ticket.name if ticket else "stream", stream.outcome.value, detail, stream.samples_sent,
                stream.batches_sent, time.monotonic() - stream.opened_s)
        self.parts.usage.closed(stream)
        self.metrics.stream_closed()

    def open_streams(self) -> int:
        """Streams open now."""
        return len(self.parts.admission)

    def stop_accepting(self) -> None:
        """Refuse new streams from now on (shutdown has begun)."""
        self.parts.admission.stop_accepting()

    def close(self) -> None:
        """Stop accepting, close every open stream, drop idle pipelines."""
        self.stop_accepting()
        parts = self.parts
        parts.watcher.close()
        for stream, _ in parts.admission.open():
            stream.close()
        parts.transports.close_all()
        parts.pool.close()
        parts.workers.close()
        close_remote(self.remote)


def _where(device: str, device_id: int) -> str:
    return f"gpu {device_id}" if device == "gpu" else "cpu"
