"""The daemon's logic without gRPC: named datasets, request checks, the plan, the
pipeline pool and the open streams. The servicer only converts messages."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import (
    ConfigError,
    FeederError,
    InvalidArgument,
    NotFound,
)
from feeder.admission import Admission, Ticket, peer_key, stream_need_bytes
from feeder.bad_samples import BadSamples, OnError, SampleFilter
from feeder.cached_runner import CachedRunner
from feeder.config import ServerConfig
from feeder.decoded_cache import DecodedCache
from feeder.devices import DevicePlacer, Placement, thread_share
from feeder.metrics import ServerMetrics
from feeder.pipeline import AugmentKind, CropRange, PipelineRunner, PipelineSpec
from feeder.plan import (
    BatchSlice,
    LastBatch,
    RankPart,
    epoch_order,
    iter_batches,
    rank_part,
    tail_skipped,
    validate_window,
)
from feeder.pool import PipelinePool, batch_bucket
from feeder.producer import BatchRunner, BatchStream, StreamContext
from shards.reader import ShardDataset, SplitIndex
from transport.base import TransportKind
from transport.daemon import TransportHub, TransportRequest

log = logging.getLogger(__name__)

__all__ = ["FeederService", "StreamSpec", "cuda_devices", "open_datasets", "resolve_device"]

MIN_IMAGE_SIZE = 16
MAX_IMAGE_SIZE = 1024
# protobuf refuses messages of 2 GiB or more; keep a batch's pixels well below.
MAX_BATCH_BYTES = 1 << 30


@dataclass(frozen=True)
class StreamSpec:
    """A request for one rank's batches (fields as in ``StreamRequest``).

    ``augment`` None means: train augmentation for the split named ``train``,
    validation transform otherwise. Train augmentation also shuffles the order.
    ``epochs`` > 1 streams ``epoch``, ``epoch + 1``, ... back to back; the cursor and
    ``max_samples`` apply to the first. ``job_id`` names the job (its ranks share it)
    and ``peer`` the client's address, both for the daemon's log.
    """

    dataset: str
    split: str
    rank: int = 0
    world_size: int = 1
    batch_size: int = 32
    image_size: int = 224
    seed: int = 0
    epoch: int = 0
    start_cursor: int = 0
    max_samples: int = 0
    epochs: int = 1
    last_batch: LastBatch = LastBatch.DROP
    augment: AugmentKind | None = None
    crop: CropRange = field(default_factory=CropRange)
    job_id: str = ""
    peer: str = ""
    antialias: bool | None = None  # resize filter; None: the daemon's default
    local_world_size: int = 0  # the job's ranks on the client's node (0: not said)

    @property
    def kind(self) -> AugmentKind:
        if self.augment is not None:
            return self.augment
        return AugmentKind.TRAIN if self.split == "train" else AugmentKind.VAL


def cuda_devices() -> int:
    """CUDA devices DALI can use (0 without a driver)."""
    from nvidia.dali import backend

    try:
        return int(getattr(backend, "GetCUDADeviceCount")())  # not in DALI's type stubs
    except RuntimeError:
        return 0


def resolve_device(device: str) -> str:
    """``auto`` -> ``gpu`` when DALI sees a CUDA device, else ``cpu``.

    Raises:
        ConfigError: ``gpu`` asked for on a machine without one.
    """
    if device == "auto":
        return "gpu" if cuda_devices() > 0 else "cpu"
    if device == "gpu" and cuda_devices() == 0:
        raise ConfigError("device: gpu asked for, but no CUDA device is visible (use auto or cpu)")
    return device


def _where(device: str, device_id: int) -> str:
    return f"gpu {device_id}" if device == "gpu" else "cpu"


def open_datasets(paths: Mapping[str, Path]) -> dict[str, ShardDataset]:
    """Open and check every configured dataset (raises on the first bad one)."""
    return {name: ShardDataset.open(name, Path(path)) for name, path in paths.items()}


# A stream read in this process (benchmarks, tests): its batches stay in the daemon's
# memory, in buffers the gRPC payload would also use.
_IN_PROCESS = TransportRequest(preference=TransportKind.GRPC)


class FeederService:
    """Serves batches of named datasets.

    Args:
        config: daemon configuration.
        datasets: opened datasets by name (see :func:`open_datasets`).
        metrics: counters to update.
    """

    def __init__(
        self, config: ServerConfig, datasets: dict[str, ShardDataset], metrics: ServerMetrics
    ) -> None:
        self.config = config
        self.datasets = datasets
        self.metrics = metrics
        self.device = resolve_device(config.device)
        self.devices = DevicePlacer.of_this_process(self.device)
        self.pool = PipelinePool(config.max_pipelines, config.pipeline_idle_s, metrics.pipelines_held)
        self.transports = TransportHub(config.transport)
        self._bad = {
            (name, split): BadSamples(name, index, config.max_pixels, metrics.bad_sample_found)
            for name, dataset in datasets.items()
            for split, index in dataset.splits.items()
        }
        self._admission: Admission[BatchStream] = Admission(config, metrics)
        self.decoded_cache: DecodedCache | None = None
        if config.decoded_cache_bytes:  # one cache for every stream and job of this daemon
            self.decoded_cache = DecodedCache(config.decoded_cache_bytes, config.decoded_cache_side)
            metrics.decoded_cache(usage=self.decoded_cache.usage())
        self._numbers = itertools.count(1)
        self._closed = threading.Event()
        threading.Thread(target=self._cancel_idle_streams, name="feeder-idle", daemon=True).start()

    def open_stream(
        self, spec: StreamSpec, cancel: Callable[[], None] = lambda: None,
        transport: TransportRequest = _IN_PROCESS,
    ) -> BatchStream:
        """Check ``spec``, admit it against the daemon's limits, plan its batches and
        start a producer.

        Args:
            spec: the request.
            cancel: ends the client's call; used when the daemon ends the stream on
                its own (idle timeout).
            transport: what the client asked for and where it runs (shared memory
                for a client on this host, else the gRPC payload).

        Raises:
            NotFound: unknown dataset or split.
            InvalidArgument: a field out of range (the message names it).
            ServiceUnavailable: shutting down, or ``max_streams`` already open, or
                ``max_pipelines`` all lent to open streams.
            ResourceExhausted: its peer's stream limit or the memory budget is reached.
        """
        split = self._split(spec)
        self._check_sizes(spec)
        part = self._part(spec, split, spec.epoch)
        validate_window(len(part), spec.start_cursor, spec.max_samples)
        slices = self._slices(spec, split, part)
        peer, need = peer_key(spec.peer), stream_need_bytes(self.config, spec.batch_size, spec.image_size)
        self._admission.check(peer, need)  # before building anything for a refused stream
        placement = self.devices.place(transport.gpu_uuid)
        try:
            runner = self.pool.acquire(self._pipeline_spec(spec, placement))
        except RuntimeError as e:  # DALI could not build the pipeline
            raise FeederError(f"pipeline: cannot build ({str(e).splitlines()[0]})") from e
        # On the client's own GPU the batches can stay there (CUDA IPC).
        sender = self.transports.open_sender(transport, spec.batch_size * spec.image_size**2 * 3,
                                             batch_gpu_uuid=placement.gpu_uuid)
        batch_runner = self._cached(runner, spec.dataset, split)
        context = StreamContext(
            split, batch_runner, sender, spec.image_size, len(part),
            self.config.queue_batches, self.config.queue_bytes,
            kind=spec.kind, seed=spec.seed, crop=spec.crop,
            samples=SampleFilter(self._bad[spec.dataset, spec.split], OnError(self.config.on_error)),
        )
        stream = BatchStream(context, slices, self.metrics, self._released)
        name = f"stream {next(self._numbers)} ({spec.peer or 'local'}, job {spec.job_id or '-'})"
        self._admit(stream, batch_runner, Ticket(name, peer, need, cancel))
        log.info("%s opened: %s/%s rank %d/%d, batch %d, %d px, %d samples from cursor %d, epochs %d-%d, over %s, "
                 "on %s with %d threads", name, spec.dataset, spec.split, spec.rank, spec.world_size, spec.batch_size,
                 spec.image_size, len(part), spec.start_cursor, spec.epoch, spec.epoch + spec.epochs - 1,
                 stream.transport, _where(runner.spec.device, runner.spec.device_id), runner.spec.threads)
        return stream.start()

    def _part(self, spec: StreamSpec, split: SplitIndex, epoch: int) -> RankPart:
        shuffle = spec.kind is AugmentKind.TRAIN
        order = epoch_order(len(split), spec.seed, epoch, shuffle=shuffle)
        return rank_part(order, spec.rank, spec.world_size, spec.last_batch)

    def _slices(self, spec: StreamSpec, split: SplitIndex, first: RankPart) -> Iterator[BatchSlice]:
        """The batches of every requested epoch; counts what ``drop`` skips."""
        for k in range(spec.epochs):
            epoch = spec.epoch + k
            part = first if k == 0 else self._part(spec, split, epoch)
            cursor, limit = (spec.start_cursor, spec.max_samples) if k == 0 else (0, 0)
            if spec.last_batch is LastBatch.DROP:
                tail = tail_skipped(len(part), cursor, spec.batch_size, limit)
                remainder = part.skipped if cursor == 0 and spec.rank == 0 else 0  # once per job
                self.metrics.samples_skipped(tail + remainder)
            yield from iter_batches(part, cursor, spec.batch_size, spec.last_batch, limit, epoch=epoch)

    def _split(self, spec: StreamSpec) -> SplitIndex:
        dataset = self.datasets.get(spec.dataset)
        if dataset is None:
            raise NotFound(f"dataset: {spec.dataset!r} is not served here (serving {sorted(self.datasets)})")
        split = dataset.splits.get(spec.split)
        if split is None:
            raise NotFound(f"split: {spec.dataset!r} has no split {spec.split!r} (has {sorted(dataset.splits)})")
        return split

    def _check_sizes(self, spec: StreamSpec) -> None:
        if spec.epochs < 1:
            raise InvalidArgument(f"epochs: must be >= 1, got {spec.epochs}")
        limit = self.config.max_batch_size
        if not 1 <= spec.batch_size <= limit:
            raise InvalidArgument(f"batch_size: {spec.batch_size} is not in 1..{limit}")
        if not MIN_IMAGE_SIZE <= spec.image_size <= MAX_IMAGE_SIZE:
            raise InvalidArgument(
                f"image_size: {spec.image_size} is not in {MIN_IMAGE_SIZE}..{MAX_IMAGE_SIZE}"
            )
        if spec.batch_size * spec.image_size**2 * 3 > MAX_BATCH_BYTES:
            raise InvalidArgument(
                f"batch_size: {spec.batch_size} images of {spec.image_size} px exceed "
                f"{MAX_BATCH_BYTES >> 20} MiB per message"
            )

    def _pipeline_spec(self, spec: StreamSpec, placement: Placement) -> PipelineSpec:
        """The pipeline of a new stream: on its placement's device, with its share of
        the ``threads`` budget (see :func:`feeder.devices.thread_share`)."""
        # The node's other ranks are likely on their way: each gets an equal share.
        pipelines = max(self.open_streams() + 1, spec.local_world_size)
        if placement.gpu_uuid:  # a GPU rank: its node's other ranks are likely on their way
            pipelines = max(pipelines, self.devices.gpu_count)
        return PipelineSpec(
            kind=spec.kind,
            device=placement.device,
            device_id=placement.device_id,
            max_batch_size=batch_bucket(spec.batch_size, self.config.max_batch_size),
            threads=thread_share(self.config.threads, pipelines),
            prefetch=self.config.prefetch,
            antialias=self.config.antialias if spec.antialias is None else spec.antialias,
            cpu_decoder=self.config.cpu_decoder,
        )

    def _cached(self, runner: PipelineRunner, dataset: str, split: SplitIndex) -> BatchRunner:
        """``runner`` behind the decoded cache, when the daemon has one."""
        if self.decoded_cache is None:
            return runner
        return CachedRunner(runner, self.decoded_cache, dataset, split, self.metrics)

    def _admit(self, stream: BatchStream, runner: BatchRunner, ticket: Ticket) -> None:
        try:
            self._admission.admit(stream, ticket)
        except FeederError:
            if isinstance(runner, CachedRunner):  # its own threads; the pipeline is pooled
                runner.close()
                runner = runner.inner
            if isinstance(runner, PipelineRunner):
                self.pool.release(runner)
            self.transports.close_sender(stream.sender)
            raise
        self.metrics.stream_opened()

    def _released(self, stream: BatchStream, runner: BatchRunner, healthy: bool) -> None:
        ticket = self._admission.release(stream)
        self.transports.close_sender(stream.sender)
        level = logging.WARNING if stream.outcome.startswith(("failed", "idle")) else logging.INFO
        log.log(level, "%s closed, %s: %d samples in %d batches, %.1f s", ticket.name if ticket else "stream",
                stream.outcome, stream.samples_sent, stream.batches_sent, time.monotonic() - stream.opened_s)
        if isinstance(runner, CachedRunner):
            runner.close()
            runner = runner.inner
        if isinstance(runner, PipelineRunner):
            self.pool.release(runner, healthy)
        self.metrics.stream_closed()

    def _cancel_idle_streams(self) -> None:
        """Until closed: cancel streams whose client took no batch for ``idle_timeout_s``."""
        timeout_s = self.config.idle_timeout_s
        while not self._closed.wait(min(1.0, timeout_s / 4)):
            for stream, ticket in self._admission.open():
                idle_s = stream.idle_s()
                if idle_s > timeout_s:
                    stream.outcome = (f"idle: no batch taken for {idle_s:.1f} s "
                                      f"(idle timeout {timeout_s:g} s), cancelled")
                    self.metrics.stream_idle_cancelled()
                    ticket.cancel()
                    stream.close()

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
