"""The daemon's logic without gRPC: named datasets, request checks, the plan, the
pipeline pool and the open streams. The servicer only converts messages."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager
from pathlib import Path

from core.bad_input import OnError
from core.errors import ConfigError, FeederError, InvalidArgument, ResourceExhausted
from core.gpus import GpuInventory
from core.workers import FairPool
from feeder.admission import Admission, Ticket, client_of, run_bytes, stream_need_bytes
from feeder.autotune import Tunable, Tuner
from feeder.bad_samples import BadSamples, FailureLimits, SampleFilter
from feeder.cached_runner import CachedRunner
from feeder.config import LIBRARY_BYTES, ServerConfig, cpu_decoder_in_use, physical_memory_bytes
from feeder.config_values import usable_cpus
from feeder.decoded_cache import DecodedCache
from feeder.devices import DevicePlacer, Placement, thread_share
from feeder.log_lines import clip
from feeder.metrics import ServerMetrics
from feeder.mixed_split import SplitView
from feeder.peers import PeerProcesses
from feeder.pipeline import PipelineSpec
from feeder.pool import PipelinePool, batch_bucket
from feeder.producer import BatchRunner, StreamContext
from feeder.remote import close_remote
from feeder.runner import PipelineRunner
from feeder.shares import FairShares, Member
from feeder.stream import BatchStream, StreamOutcome
from feeder.stream_source import find_source
from feeder.usage import Usage
from protocol.mix import Mix
from protocol.plan import BatchSlice, RankPart, check_epochs_hold_batches, validate_window
from protocol.request import StreamSpec
from protocol.stream_plan import Skipped, plan_stream, rank_part_of
from shards.ranged import READ_AHEAD_BYTES, RemoteAccess
from shards.reader import ShardDataset
from transport.base import TransportKind
from transport.daemon import TransportHub, TransportRequest

log = logging.getLogger(__name__)

__all__ = ["FeederService", "cuda_devices", "open_datasets", "resolve_device"]

def cuda_devices() -> int:
    """CUDA devices this process sees (0 without CUDA): the size of its
    :class:`~core.gpus.GpuInventory`."""
    return len(GpuInventory.of_this_process())


def resolve_device(device: str, gpus: GpuInventory | None = None) -> str:
    """``auto`` -> ``gpu`` when the process sees a CUDA device (``gpus``, else asked
    now), else ``cpu``.

    Raises:
        ConfigError: ``gpu`` asked for on a machine without one.
    """
    if device == "cpu":
        return device
    count = len(gpus if gpus is not None else GpuInventory.of_this_process())
    if device == "auto":
        return "gpu" if count > 0 else "cpu"
    if device == "gpu" and count == 0:
        raise ConfigError("device: gpu asked for, but no CUDA device is visible (use auto or cpu)")
    return device


def _where(device: str, device_id: int) -> str:
    return f"gpu {device_id}" if device == "gpu" else "cpu"


def _say_footprint(config: ServerConfig, datasets: Mapping[str, ShardDataset]) -> None:
    """One line on the most memory this daemon should take; a warning where that is
    more than the machine has."""
    gib = 1 << 30
    remote_splits = sum(len(d.splits) for d in datasets.values() if not isinstance(d.root, Path))
    read_ahead = READ_AHEAD_BYTES * remote_splits
    footprint, physical = config.footprint_bytes + read_ahead, physical_memory_bytes()
    level = logging.WARNING if footprint > physical else logging.INFO
    log.log(level, "memory: at most %.1f GiB (streams %.1f, shared memory %.1f, decoded cache %.1f, remote read-ahead "
            "%.1f, libraries %.1f) of the machine's %.1f GiB", footprint / gib, config.max_memory_bytes / gib,
            config.shm_budget_bytes / gib, config.decoded_cache_bytes / gib, read_ahead / gib, LIBRARY_BYTES / gib,
            physical / gib)


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
        # The GPUs are asked for once, and not at all by a CPU daemon.
        gpus = GpuInventory() if config.device == "cpu" else GpuInventory.of_this_process()
        self.device = resolve_device(config.device, gpus)
        _say_footprint(config, datasets)
        self.devices = DevicePlacer.of_this_process(self.device, gpus)
        # The node's decode threads (``--threads``), shared fairly by every stream
        # (``--fair-share``: by stream, or by job).
        self.workers = FairPool(config.decode_threads)
        self.shares = FairShares(self.workers, config.fair_share)
        self._peers = PeerProcesses()
        self._usage = Usage(metrics)
        self.pool = PipelinePool(config.max_pipelines, config.pipeline_idle_s, metrics.pipelines_held,
                                 workers=self.workers)
        self.transports = TransportHub(config.transport)
        self._bad = {
            (name, split): BadSamples(name, index, config.max_pixels, metrics.bad_sample_found)
            for name, dataset in datasets.items()
            for split, index in dataset.splits.items()
        }
        self._admission: Admission[BatchStream] = Admission(config, metrics)
        # What is not given is tuned while streams run (--threads, --prefetch left at 0).
        self.tuner = Tuner(lambda: [stream for stream, _ in self._admission.open()], metrics, usable_cpus(),
                           self.workers, tune_threads=config.autotune and not config.threads,
                           grant=self._grant_prefetch if config.autotune and not config.prefetch else None)
        self.decoded_cache: DecodedCache | None = None
        if config.decoded_cache_bytes:  # one cache for every stream and job of this daemon
            self.decoded_cache = DecodedCache(config.decoded_cache_bytes, config.decoded_cache_side)
            metrics.decoded_cache(usage=self.decoded_cache.usage())
        self._numbers = itertools.count(1)
        self._opening = 0  # streams being opened now (guarded by _lock)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        threading.Thread(target=self._watch_streams, name="feeder-idle", daemon=True).start()

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
            InvalidArgument: a batch larger than ``max_batch_size``, a cursor past the
                rank's part.
            ServiceUnavailable: shutting down.
            ResourceExhausted: ``max_streams`` already open, ``max_pipelines`` all lent
                to open streams, its client's or job's stream limit or the memory
                budget reached (the message names which).
            FeederError: DALI could not build the pipeline.
        """
        source = find_source(spec, self.datasets, self._bad, self.config.pixel_options)
        if spec.batch_size > self.config.max_batch_size:
            raise InvalidArgument(f"batch_size: {spec.batch_size} is not in 1..{self.config.max_batch_size}")
        part = rank_part_of(spec, source.plan, spec.epoch)
        validate_window(len(part), spec.start_cursor, spec.max_samples)
        check_epochs_hold_batches(len(source.plan) if isinstance(source.plan, Mix) else source.plan,
                                  spec.world_size, spec.rank, spec.batch_size, spec.last_batch,
                                  f"{clip(spec.dataset)}/{clip(spec.split)}")
        client = client_of(peer, transport.client.pid if transport.client is not None else 0, self._peers)
        job, need = spec.job_id or client.key, stream_need_bytes(self.config, spec.batch_size, spec.image_size)
        self._admission.check(client, job, need)  # before building anything for a refused stream
        number = next(self._numbers)
        process = f" {clip(client.key)}" if client.key.startswith("pid=") else ""
        name = f"stream {number} ({clip(peer or 'local')}{process}, job {clip(spec.job_id or '-')})"
        with self._counted_opening(), ExitStack() as parts:
            placement = self.devices.place(transport.gpu_uuid)
            runner = self._lend_runner(self._pipeline_spec(spec, placement), parts)
            # On the client's own GPU the batches can stay there (CUDA IPC).
            sender = self.transports.open_sender(transport, spec.batch_bytes, batch_gpu_uuid=placement.gpu_uuid,
                                                 slots=self.config.stream_ring_slots(transport.prefetch_batches))
            parts.callback(self.transports.close_sender, sender)
            limits = FailureLimits(self.config.max_failed_batch_fraction, self.config.max_failed_epoch_fraction,
                                   len(part), source.part_lengths(part))
            context = StreamContext(
                source.split, self._cached(runner, spec.dataset, source.split), spec.image_size, len(part),
                SampleFilter(source.bad, OnError(self.config.on_error), limits),
                self.config.queue_batches, self.config.queue_bytes, kind=spec.kind, seed=spec.seed, crop=spec.crop,
            )
            stream = BatchStream(context, sender, self._slices(spec, source.plan, part), self.metrics, str(number))
            self._admission.admit(stream, Ticket(name, client, job, need, cancel,
                                                 run_bytes(spec.batch_size, spec.image_size)))
            parts.callback(self._ended, stream)
            self.shares.join(stream, Member(runner.lane, job, client.key))
            parts.callback(self.shares.leave, stream)
            self._usage.opened(stream, job)
            self.metrics.stream_opened()
            stream.own(parts.pop_all())
        log.info("%s opened: %s/%s rank %d/%d, batch %d, %d px, %d samples from cursor %d, epochs %d-%d, over %s, "
                 "on %s with %d threads", name, spec.dataset, spec.split, spec.rank, spec.world_size, spec.batch_size,
                 spec.image_size, len(part), spec.start_cursor, spec.epoch, spec.epoch + spec.epochs - 1,
                 sender.kind.name.lower(), _where(runner.spec.device, runner.spec.device_id), runner.spec.threads)
        return stream.start()

    @contextmanager
    def _counted_opening(self) -> Iterator[None]:
        """Counts a stream as opening while it is built (its thread share counts it
        and every other stream being opened at the same moment)."""
        with self._lock:
            self._opening += 1
        try:
            yield
        finally:
            with self._lock:
                self._opening -= 1

    def _grant_prefetch(self, stream: Tunable, runs: int) -> bool:
        """Set ``stream``'s runs in flight to ``runs`` where the memory budget has
        room for them (the tuner's ask)."""
        if not isinstance(stream, BatchStream) or not self._admission.set_runs(stream, runs - stream.prefetch):
            return False
        stream.prefetch = runs
        return True

    def _lend_runner(self, spec: PipelineSpec, parts: ExitStack) -> PipelineRunner:
        """A pooled runner for ``spec``, given back when ``parts`` closes."""
        try:
            runner = self.pool.acquire(spec)
        except ResourceExhausted:
            self._admission.ran_out("max_pipelines")
            raise
        except RuntimeError as e:  # DALI could not build the pipeline
            raise FeederError(f"pipeline: cannot build ({str(e).splitlines()[0]})") from e
        parts.callback(self.pool.release, runner)
        runner.lookahead, runner.prefetch = self.config.lookahead, spec.prefetch  # a pooled one may have been tuned
        return runner

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

    def _pipeline_spec(self, spec: StreamSpec, placement: Placement) -> PipelineSpec:
        """The pipeline of a new stream, on its placement's device. Its CPU work runs
        on the daemon's shared workers (``--threads`` in all); only where DALI decodes
        (a GPU, or a CPU without the window decoder) does the pipeline get threads of
        its own, DALI's: a share of the budget among the streams open or opening
        (see :func:`feeder.devices.thread_share`), fixed when DALI builds it."""
        threads = 1  # the window decoder: no threads of its own, one spec for every stream
        if placement.device == "gpu" or cpu_decoder_in_use(self.config.cpu_decoder) == "dali":
            # The node's other ranks are likely on their way: each gets an equal share.
            pipelines = max(self.open_streams() + self._opening, spec.local_world_size)
            if placement.gpu_uuid:  # a GPU rank: its node's other ranks are likely on their way
                pipelines = max(pipelines, self.devices.gpu_count)
            threads = thread_share(self.config.decode_threads, pipelines)
        on_gpu = placement.device == "gpu"
        return PipelineSpec(
            device=placement.device,
            device_id=placement.device_id,
            max_batch_size=batch_bucket(spec.batch_size, self.config.max_batch_size),
            threads=threads,
            prefetch=self.config.gpu_stream_prefetch if on_gpu else self.config.stream_prefetch,
            antialias=self.config.antialias if spec.antialias is None else spec.antialias,
            cpu_decoder=self.config.cpu_decoder,
            hw_decoder_load=self.devices.hw_decoder_load(placement.device_id, self.config.hw_decoder_load),
            cpu_decode_share=self.config.cpu_decode_share if on_gpu else 0.0,
        )

    def _cached(self, runner: PipelineRunner, dataset: str, split: SplitView) -> BatchRunner:
        """``runner`` behind the decoded cache, when the daemon has one."""
        if self.decoded_cache is None:
            return runner
        return CachedRunner(runner, self.decoded_cache, dataset, split, self.metrics)

    def _ended(self, stream: BatchStream) -> None:
        """A stream's last part to go: its admission, and the line that says how it ended."""
        ticket = self._admission.release(stream)
        failed = stream.outcome in (StreamOutcome.FAILED, StreamOutcome.IDLE)
        detail = f": {stream.detail}" if stream.detail else ""
        log.log(logging.WARNING if failed else logging.INFO, "%s closed, %s%s: %d samples in %d batches, %.1f s",
                ticket.name if ticket else "stream", stream.outcome.value, detail, stream.samples_sent,
                stream.batches_sent, time.monotonic() - stream.opened_s)
        self._usage.closed(stream)
        self.metrics.stream_closed()

    def _watch_streams(self) -> None:
        """Until closed, about once a second: cancel streams whose client took no batch
        for ``idle_timeout_s`` (``contended_idle_timeout_s`` while another client is
        refused for what they hold), report what each stream and job uses, and give
        back the device rings that ended streams' clients have let go of."""
        tick_s = min(1.0, self.config.idle_timeout_s / 4, self.config.contended_idle_timeout_s / 4)
        while not self._closed.wait(tick_s):
            timeout_s = self.config.idle_timeout_s
            if self._admission.contended():
                timeout_s = min(timeout_s, self.config.contended_idle_timeout_s)
            streams = self._admission.open()
            for stream, ticket in streams:
                idle_s = stream.idle_s()
                if idle_s > timeout_s:
                    stream.mark_idle(f"no batch taken for {idle_s:.1f} s (idle timeout {timeout_s:g} s), cancelled")
                    self.metrics.stream_idle_cancelled()
                    ticket.cancel()
                    stream.close()
            self._usage.tick()
            self.tuner.tick()
            self.transports.collect()  # device rings of ended streams, once their clients let go

    def open_streams(self) -> int:
        """Streams open now."""
        return len(self._admission)

    def stop_accepting(self) -> None:
        """Refuse new streams from now on (shutdown has begun)."""
        self._admission.stop_accepting()

    def close(self) -> None:
        """Stop accepting, close every open stream, drop idle pipelines."""
        self.stop_accepting()
        self._closed.set()
        for stream, _ in self._admission.open():
            stream.close()
        self.transports.close_all()
        self.pool.close()
        self.workers.close()
        close_remote(self.remote)
