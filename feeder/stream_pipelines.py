"""A new stream's pipeline: chosen for its request and device, lent from the pool
of built pipelines, and put behind the decoded cache where the daemon has one."""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Iterator
from contextlib import ExitStack, contextmanager

from core.errors import FeederError, ResourceExhausted
from decode.cached_runner import CachedRunner
from decode.decoded_cache import DecodedCache
from decode.devices import DevicePlacer, Placement, thread_share
from decode.pipeline import PipelineSpec
from decode.pool import PipelinePool, batch_bucket
from decode.registry import DECODERS, cpu_decoder_in_use
from decode.runner import PipelineRunner
from feeder.config import ServerConfig
from feeder.metrics import ServerMetrics
from feeder.mixed_split import MixedSplit, SplitView
from feeder.producer import BatchRunner
from protocol.request import AugmentKind, StreamSpec

__all__ = ["StreamPipelines", "cache_key"]


class StreamPipelines:
    """Pipelines for the streams of one daemon.

    Args:
        config: the decode options (``threads``, ``prefetch``, ``cpu_decoder``,
            ``hw_decoder_load``, ``cpu_decode_share``, ``antialias``, ``lookahead``).
        devices: where a stream's pipeline may run.
        pool: the built pipelines, lent to streams.
        decoded_cache: the daemon's decoded cache, or None.
        metrics: where the cache's hits are counted.
        open_streams: streams open now (a new DALI pipeline's thread share counts them).
        ran_out: called with ``"max_pipelines"`` when the pool has none to lend.
    """

    def __init__(self, config: ServerConfig, devices: DevicePlacer, pool: PipelinePool,
                 decoded_cache: DecodedCache | None, metrics: ServerMetrics, open_streams: Callable[[], int],
                 ran_out: Callable[[str], None]) -> None:
        self._config = config
        self._devices = devices
        self._pool = pool
        self._cache = decoded_cache
        self._metrics = metrics
        self._open_streams = open_streams
        self._ran_out = ran_out
        self._opening = 0  # streams being opened now (guarded by _lock)
        self._lock = threading.Lock()

    @contextmanager
    def opening(self) -> Iterator[None]:
        """Counts a stream as opening while it is built (its thread share counts it
        and every other stream being opened at the same moment)."""
        with self._lock:
            self._opening += 1
        try:
            yield
        finally:
            with self._lock:
                self._opening -= 1

    def spec_for(self, spec: StreamSpec, placement: Placement) -> PipelineSpec:
        """The pipeline of a new stream, on its placement's device. Its CPU work runs
        on the daemon's shared workers (``--threads`` in all); only where its decoder
        has threads of its own (DALI's: on a GPU, or ``--cpu-decoder dali``) does the
        pipeline get some: a share of the budget among the streams open or opening
        (see :func:`decode.devices.thread_share`), fixed when DALI builds it."""
        config = self._config
        threads = 1  # a decoder on the lane: no threads of its own, one spec for every stream
        if placement.device == "gpu" or DECODERS[cpu_decoder_in_use(config.decoding.cpu_decoder)].own_threads:
            # The node's other ranks are likely on their way: each gets an equal share.
            pipelines = max(self._open_streams() + self._opening, spec.local_world_size)
            if placement.gpu_uuid:  # a GPU rank: its node's other ranks are likely on their way
                pipelines = max(pipelines, self._devices.gpu_count)
            threads = thread_share(config.tuning.decode_threads, pipelines)
        on_gpu = placement.device == "gpu"
        return PipelineSpec(
            device=placement.device,
            device_id=placement.device_id,
            max_batch_size=batch_bucket(spec.batch_size, config.budgets.max_batch_size),
            threads=threads,
            prefetch=config.tuning.gpu_stream_prefetch if on_gpu else config.tuning.stream_prefetch,
            antialias=config.decoding.antialias if spec.antialias is None else spec.antialias,
            cpu_decoder=config.decoding.cpu_decoder,
            hw_decoder_load=self._devices.hw_decoder_load(placement.device_id, config.gpu.hw_decoder_load),
            cpu_decode_share=config.gpu.cpu_decode_share if on_gpu else 0.0,
            # The GPU's graph tones training batches where a photometric step is on (the CPU's stage needs no spec).
            photometric=on_gpu and config.jitter.on and spec.kind is AugmentKind.TRAIN,
        )

    def lend(self, spec: PipelineSpec, parts: ExitStack) -> PipelineRunner:
        """A pooled runner for ``spec``, given back when ``parts`` closes.

        Raises:
            ResourceExhausted: ``max_pipelines`` all lent to open streams.
            FeederError: DALI could not build the pipeline.
        """
        try:
            runner = self._pool.acquire(spec)
        except ResourceExhausted:
            self._ran_out("max_pipelines")
            raise
        except RuntimeError as e:  # DALI could not build the pipeline
            raise FeederError(f"pipeline: cannot build ({str(e).splitlines()[0]})") from e
        parts.callback(self._pool.release, runner)
        # A pooled runner may have been tuned.
        runner.lookahead, runner.prefetch = self._config.tuning.lookahead, spec.prefetch
        return runner

    def cached(self, runner: PipelineRunner, dataset: str, split: SplitView) -> BatchRunner:
        """``runner`` behind the decoded cache, when the daemon has one."""
        if self._cache is None:
            return runner
        return CachedRunner(runner, self._cache, split, cache_key(dataset, split), self._metrics)


def cache_key(dataset: str, split: SplitView) -> Callable[[int], Hashable]:
    """The decoded cache's key of a sample index of ``split``: (dataset, split, index)
    of the dataset the sample is of, so plain and mixed streams of a dataset share
    entries."""
    if isinstance(split, MixedSplit):
        def key(index: int) -> Hashable:
            part, local = split.locate(index)
            return part.name, part.split.split, local
        return key
    return lambda index: (dataset, split.split, index)
