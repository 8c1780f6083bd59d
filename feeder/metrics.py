"""Counters of one daemon: exported to Prometheus (a registry per server, so several
servers in one process do not collide) and summarised for the ``GetStats`` RPC."""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from feeder.decoded_cache import CacheUsage
    from shards.shard_cache import ShardCache
    from shards.store import StoreCounters

__all__ = ["ServerMetrics", "Stats"]

_FAILED_NAMED = 16  # bad samples GetStats names (the latest found)
_STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


@dataclass(frozen=True)
class Stats:
    """Totals since the daemon started (``GetStats``)."""

    images_served: int
    batches_served: int
    bytes_sent: int
    open_streams: int
    streams_opened: int
    errors: int
    uptime_s: float
    samples_skipped: int
    samples_failed: int = 0
    failed_keys: tuple[str, ...] = ()
    pipelines: int = 0
    decoded_cache_hits: int = 0
    decoded_cache_misses: int = 0
    decoded_cache_bypassed: int = 0
    decoded_cache_entries: int = 0
    decoded_cache_bytes: int = 0
    decoded_cache_budget_bytes: int = 0
    gpu_batches: int = 0
    gpu_host_copies: int = 0
    store_requests: int = 0
    store_retries: int = 0
    store_failures: int = 0
    store_bytes_fetched: int = 0
    shard_cache_hits: int = 0
    shard_cache_misses: int = 0
    shard_cache_downloads: int = 0
    shard_cache_download_failures: int = 0
    shard_cache_evictions: int = 0
    shard_cache_shards: int = 0
    shard_cache_bytes: int = 0
    shard_cache_budget_bytes: int = 0


class _RemoteCollector:
    """The store's and the shard cache's counters, read when Prometheus scrapes."""

    def __init__(self, counters: StoreCounters, cache: ShardCache | None) -> None:
        self._counters, self._cache = counters, cache

    def describe(self) -> list[Metric]:
        return []  # collected on each scrape, not at registration

    def collect(self) -> Iterator[Metric]:
        store = self._counters.snapshot()
        for name, key, text in (
            ("feeder_store_requests", "requests", "Requests made to object stores (ranged GETs, downloads, lists)."),
            ("feeder_store_retries", "retries", "Requests to object stores retried after a transient failure."),
            ("feeder_store_failures", "failures", "Requests to object stores that failed for good, or gave up."),
            ("feeder_store_bytes_fetched", "bytes", "Bytes read from (or written to) object stores."),
        ):
            yield CounterMetricFamily(name, text, value=store[key])
        if self._cache is None:
            return
        usage = self._cache.usage()
        samples = CounterMetricFamily("feeder_shard_cache_samples", "Samples of remote datasets by where they "
                                      "were read: hit (the node-local copy), miss (ranged GETs).", labels=["outcome"])
        samples.add_metric(["hit"], usage.hits)
        samples.add_metric(["miss"], usage.misses)
        yield samples
        yield CounterMetricFamily("feeder_shard_cache_downloads", "Shards fetched whole and cached.",
                                  value=usage.downloads)
        yield CounterMetricFamily("feeder_shard_cache_evictions", "Cached shards evicted past --cache-bytes.",
                                  value=usage.evictions)
        yield GaugeMetricFamily("feeder_shard_cache_bytes", "Bytes of shards in the node-local cache.",
                                value=usage.cached_bytes)
        yield GaugeMetricFamily("feeder_shard_cache_budget_bytes", "The shard cache's budget (--cache-bytes; "
                                "lowered to what it holds when its disk is full).", value=usage.budget_bytes)


class ServerMetrics:
    """Thread-safe counters, mirrored into a private Prometheus registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._started_s = time.monotonic()
        self._lock = threading.Lock()
        self._totals = dict(
            images=0, batches=0, bytes=0, open=0, opened=0, errors=0, skipped=0, failed=0, pipelines=0,
            gpu_batches=0, gpu_host_copies=0,
        )
        self._failed_names: deque[str] = deque(maxlen=_FAILED_NAMED)
        self._cache = dict(hits=0, misses=0, bypassed=0, entries=0, bytes=0, budget_bytes=0)
        self._remote: tuple[StoreCounters, ShardCache | None] | None = None
        r = self.registry
        self.images = Counter("feeder_images", "Images sent to clients.", registry=r)
        self.batches = Counter("feeder_batches", "Batches sent to clients.", registry=r)
        self.bytes = Counter("feeder_bytes_sent", "Image bytes sent to clients.", registry=r)
        self.errors = Counter("feeder_errors", "Streams ended by an error.", ["kind"], registry=r)
        self.skipped = Counter(
            "feeder_samples_skipped", "Samples skipped by the drop policy.", registry=r
        )
        self.failed = Counter(
            "feeder_samples_failed", "Samples that could not be served (undecodable or over --max-pixels) "
            "and were replaced by a repeat of another sample.", ["dataset", "split"], registry=r,
        )
        self.retries = Counter(
            "feeder_decode_retries", "Pipeline runs repeated after samples failed to decode.", registry=r
        )
        self.gpu_outputs = Counter(
            "feeder_gpu_batches", "Batches decoded on a GPU, by where they went: 'device' (straight into "
            "the client's CUDA IPC slot) or 'host' (copied through host memory).", ["to"], registry=r,
        )
        self.pipelines = Gauge("feeder_pipelines", "Built pipelines, lent to streams or idle.", registry=r)
        self.open_streams = Gauge("feeder_open_streams", "Streams open now.", registry=r)
        self.queued = Gauge("feeder_queued_batches", "Ready batches waiting in stream queues.", registry=r)
        self.queued_bytes = Gauge("feeder_queued_bytes", "Bytes of ready batches in stream queues.", registry=r)
        self.reserved = Gauge(
            "feeder_reserved_bytes", "Estimated memory of the open streams (see --max-memory-bytes).", registry=r
        )
        self.memory_budget = Gauge("feeder_memory_budget_bytes", "The --max-memory-bytes budget.", registry=r)
        self.refused = Counter(
            "feeder_streams_refused", "Streams refused by a limit.", ["reason"], registry=r
        )
        self.unauthenticated = Counter(
            "feeder_unauthenticated", "Calls refused for a missing or wrong token.", registry=r
        )
        self.waiting_calls = Gauge(
            "feeder_waiting_calls", "Calls waiting for their request message now (see --max-waiting-calls).",
            registry=r,
        )
        self.calls_refused = Counter(
            "feeder_calls_refused", "Calls ended before their handler ran: 'waiting' (cancelled after the "
            "longest wait, to let a newer call wait past --max-waiting-calls), 'timeout' (no request message "
            "within --first-message-timeout-s), 'malformed' (not a valid request message).", ["reason"], registry=r,
        )
        self.scrapes_refused = Counter(
            "feeder_metrics_scrapes_refused", "Metrics connections not served: 'token' (missing or wrong), "
            "'busy' (too many connections pending).", ["reason"], registry=r,
        )
        self.idle_cancelled = Counter(
            "feeder_streams_idle_cancelled", "Streams cancelled after --idle-timeout-s unread.", registry=r
        )
        self.cache_lookups = Counter(
            "feeder_decoded_cache_samples", "Samples by what the decoded cache did: hit, miss "
            "(decoded from JPEG), bypassed (image size above the cached side).", ["outcome"], registry=r,
        )
        self.cache_entries = Gauge("feeder_decoded_cache_entries", "Images in the decoded cache.", registry=r)
        self.cache_bytes = Gauge("feeder_decoded_cache_bytes", "Bytes the decoded cache holds.", registry=r)
        self.cache_budget = Gauge("feeder_decoded_cache_budget_bytes", "Decoded cache budget.", registry=r)
        self.stream_threads = Gauge(
            "feeder_stream_threads", "Decode threads each open stream kept busy over the last interval: its "
            "share of --threads (DALI's own threads not counted).", ["stream"], registry=r,
        )
        self.stream_queue_fill = Gauge(
            "feeder_stream_queue_fill", "Share of each open stream's ready queue that is filled (near 1: its "
            "consumer is the slow side; near 0: it waits for the daemon).", ["stream"], registry=r,
        )
        self.stream_cpu = Gauge(
            "feeder_stream_cpu_seconds", "CPU seconds each open stream's decodes and resizes have taken on the "
            "decode threads since the stream opened.", ["stream"], registry=r,
        )
        self._job_metrics(r)
        self.stream_consumer_wait = Gauge(
            "feeder_stream_consumer_wait_seconds", "Seconds each open stream's consumer has waited for a "
            "batch since the stream opened.", ["stream"], registry=r,
        )
        self.stage_s = Histogram(
            "feeder_stage_seconds", "Seconds per batch in each stage.", ["stage"],
            buckets=_STAGE_BUCKETS_S, registry=r,
        )

    def _job_metrics(self, r: CollectorRegistry) -> None:
        """Per job: a job's labels exist while it has a stream open (jobs are
        bounded by ``max_streams``)."""
        self.job_streams = Gauge("feeder_job_streams", "Streams each job has open.", ["job"], registry=r)
        self.job_threads = Gauge(
            "feeder_job_threads", "Decode threads each job's streams kept busy over the last interval: its "
            "share of --threads (see --fair-share).", ["job"], registry=r,
        )
        self.job_decode_s = Counter(
            "feeder_job_decode_seconds", "Seconds of the decode threads each job's streams have taken (wall time "
            "on the workers, what --fair-share shares).", ["job"], registry=r,
        )
        self.job_cpu_s = Counter(
            "feeder_job_cpu_seconds", "CPU seconds of the decode threads each job's streams have taken.",
            ["job"], registry=r,
        )
        self.job_images = Counter("feeder_job_images", "Images sent to each job's streams.", ["job"], registry=r)
        self.job_images_per_s = Gauge(
            "feeder_job_images_per_second", "Images per second sent to each job's streams over the last interval.",
            ["job"], registry=r,
        )

    def job_used(self, job: str, decode_s: float, cpu_s: float, images: int) -> None:
        """What job ``job``'s streams took since it was last told."""
        self.job_decode_s.labels(job=job).inc(max(0.0, decode_s))
        self.job_cpu_s.labels(job=job).inc(max(0.0, cpu_s))
        self.job_images.labels(job=job).inc(images)

    def job_rates(self, job: str, streams: int, threads: float, images_per_s: float) -> None:
        """What job ``job`` has open and took over the last interval."""
        self.job_streams.labels(job=job).set(streams)
        self.job_threads.labels(job=job).set(threads)
        self.job_images_per_s.labels(job=job).set(images_per_s)

    def job_gone(self, job: str) -> None:
        """Job ``job``'s last stream closed: its labels go."""
        for metric in (self.job_streams, self.job_threads, self.job_decode_s, self.job_cpu_s, self.job_images,
                       self.job_images_per_s):
            try:
                metric.remove(job)
            except KeyError:
                pass  # never reported

    def _add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._totals[name] += amount

    def stream_opened(self) -> None:
        self._add(open=1, opened=1)
        self.open_streams.inc()

    def stream_closed(self) -> None:
        self._add(open=-1)
        self.open_streams.dec()

    def stream_refused(self, reason: str) -> None:
        self.refused.labels(reason=reason).inc()

    def unauthenticated_call(self) -> None:
        self.unauthenticated.inc()

    def call_waiting(self, change: int) -> None:
        """A call began (+1) or ended (-1) waiting for its request message."""
        self.waiting_calls.inc(change)

    def call_refused(self, reason: str) -> None:
        self.calls_refused.labels(reason=reason).inc()

    def scrape_refused(self, reason: str) -> None:
        self.scrapes_refused.labels(reason=reason).inc()

    def stream_idle_cancelled(self) -> None:
        self.idle_cancelled.inc()

    def batch_sent(self, images: int, nbytes: int) -> None:
        self._add(images=images, batches=1, bytes=nbytes)
        self.images.inc(images)
        self.batches.inc()
        self.bytes.inc(nbytes)

    def error(self, kind: str) -> None:
        self._add(errors=1)
        self.errors.labels(kind=kind).inc()

    def samples_skipped(self, count: int) -> None:
        self._add(skipped=count)
        self.skipped.inc(count)

    def samples_failed(self, dataset: str, split: str, count: int) -> None:
        """``count`` samples of a batch were replaced (``--on-error skip``)."""
        self._add(failed=count)
        self.failed.labels(dataset=dataset, split=split).inc(count)

    def bad_sample_found(self, name: str) -> None:
        """A sample found bad for the first time (``dataset/split/key: reason``)."""
        with self._lock:
            self._failed_names.append(name)

    def pipelines_held(self, count: int) -> None:
        """Pipelines built and not yet dropped, now."""
        with self._lock:
            self._totals["pipelines"] = count
        self.pipelines.set(count)

    def gpu_batches(self, count: int, via_host: int) -> None:
        """``count`` batches decoded on a GPU, ``via_host`` of them copied to host memory."""
        self._add(gpu_batches=count, gpu_host_copies=via_host)
        self.gpu_outputs.labels(to="device").inc(count - via_host)
        self.gpu_outputs.labels(to="host").inc(via_host)

    def decode_retried(self) -> None:
        self.retries.inc()

    def stream_usage(self, stream: str, threads: float, queue_fill: float, consumer_wait_s: float,
                     cpu_s: float = 0.0) -> None:
        """What open stream ``stream`` uses now (see the ``feeder_stream_*`` gauges)."""
        self.stream_threads.labels(stream=stream).set(threads)
        self.stream_cpu.labels(stream=stream).set(cpu_s)
        self.stream_queue_fill.labels(stream=stream).set(queue_fill)
        self.stream_consumer_wait.labels(stream=stream).set(consumer_wait_s)

    def stream_gone(self, stream: str) -> None:
        """Stream ``stream`` closed: its gauges go."""
        for gauge in (self.stream_threads, self.stream_queue_fill, self.stream_consumer_wait, self.stream_cpu):
            try:
                gauge.remove(stream)
            except KeyError:
                pass  # never reported

    def decoded_cache(self, usage: CacheUsage, hits: int = 0, misses: int = 0, bypassed: int = 0) -> None:
        """Samples a batch found, missed or bypassed in the decoded cache, and what it
        holds now."""
        with self._lock:
            c = self._cache
            c["hits"], c["misses"], c["bypassed"] = c["hits"] + hits, c["misses"] + misses, c["bypassed"] + bypassed
            c["entries"], c["bytes"], c["budget_bytes"] = usage.entries, usage.used_bytes, usage.budget_bytes
        for outcome, count in (("hit", hits), ("miss", misses), ("bypassed", bypassed)):
            if count:
                self.cache_lookups.labels(outcome=outcome).inc(count)
        self.cache_entries.set(usage.entries)
        self.cache_bytes.set(usage.used_bytes)
        self.cache_budget.set(usage.budget_bytes)

    def watch_remote(self, counters: StoreCounters, cache: ShardCache | None) -> None:
        """Report the object stores' counters and the shard cache (``GetStats``, and
        the ``feeder_store_*`` and ``feeder_shard_cache_*`` metrics)."""
        self._remote = (counters, cache)
        self.registry.register(_RemoteCollector(counters, cache))

    def _remote_stats(self) -> dict[str, int]:
        if self._remote is None:
            return {}
        counters, cache = self._remote
        found = {f"store_{name}": value for name, value in counters.snapshot().items()}
        found["store_bytes_fetched"] = found.pop("store_bytes")
        if cache is not None:
            usage = cache.usage()
            found |= {f"shard_cache_{name}": value for name, value in usage._asdict().items()}
            found["shard_cache_shards"] = found.pop("shard_cache_cached_shards")
            found["shard_cache_bytes"] = found.pop("shard_cache_cached_bytes")
        return found

    def stage(self, name: str, seconds: float) -> None:
        self.stage_s.labels(stage=name).observe(seconds)

    def stats(self) -> Stats:
        with self._lock:
            t = dict(self._totals)
            failed_names = tuple(self._failed_names)
            cache = {f"decoded_cache_{name}": value for name, value in self._cache.items()}
        return Stats(
            images_served=t["images"],
            batches_served=t["batches"],
            bytes_sent=t["bytes"],
            open_streams=t["open"],
            streams_opened=t["opened"],
            errors=t["errors"],
            uptime_s=time.monotonic() - self._started_s,
            samples_skipped=t["skipped"],
            samples_failed=t["failed"],
            failed_keys=failed_names,
            pipelines=t["pipelines"],
            **cache,
            gpu_batches=t["gpu_batches"],
            gpu_host_copies=t["gpu_host_copies"],
            **self._remote_stats(),
        )
