"""Counters of one daemon: exported to Prometheus (a registry per server, so several
servers in one process do not collide). The totals ``GetStats`` reports are declared
once, in :mod:`feeder.ledger`; callers count through the methods here."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
)

from feeder.ledger import Ledger, Stats

if TYPE_CHECKING:
    from feeder.decoded_cache import CacheUsage
    from shards.shard_cache import ShardCache
    from shards.store import StoreCounters

__all__ = ["ServerMetrics", "Stats"]

_FAILED_NAMED = 16  # bad samples GetStats names (the latest found)
_STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)


def _remote_totals(counters: StoreCounters, cache: ShardCache | None) -> dict[str, float]:
    """The object stores' counters and the shard cache's, by their ``TOTALS`` names."""
    store = counters.snapshot()
    found: dict[str, float] = {"store_requests": store["requests"], "store_retries": store["retries"],
                               "store_failures": store["failures"], "store_bytes_fetched": store["bytes"]}
    if cache is not None:
        usage = cache.usage()
        found |= {"shard_cache_hits": usage.hits, "shard_cache_misses": usage.misses,
                  "shard_cache_downloads": usage.downloads, "shard_cache_download_failures": usage.download_failures,
                  "shard_cache_evictions": usage.evictions, "shard_cache_shards": usage.cached_shards,
                  "shard_cache_bytes": usage.cached_bytes, "shard_cache_budget_bytes": usage.budget_bytes}
    return found


class ServerMetrics:
    """Thread-safe counters, mirrored into a private Prometheus registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._started_s = time.monotonic()
        self._lock = threading.Lock()
        self._failed_names: deque[str] = deque(maxlen=_FAILED_NAMED)
        self.ledger = Ledger()  # the totals of GetStats, exported under their TOTALS rows' families
        self.registry.register(self.ledger)
        self.ledger.read_from(lambda: {"uptime_s": time.monotonic() - self._started_s})
        r = self.registry
        self.retries = Counter(
            "feeder_decode_retries", "Pipeline runs repeated after samples failed to decode.", registry=r
        )
        self._queued = Gauge("feeder_queued_batches", "Ready batches waiting in stream queues.", registry=r)
        self._queued_bytes = Gauge("feeder_queued_bytes", "Bytes of ready batches in stream queues.", registry=r)
        self._reserved = Gauge(
            "feeder_reserved_bytes", "Estimated memory of the open streams (see --max-memory-bytes).", registry=r
        )
        self._memory_budget = Gauge("feeder_memory_budget_bytes", "The --max-memory-bytes budget.", registry=r)
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
        self._tuned_threads = Gauge("feeder_tuned_threads", "Decode threads: as the tuner set them, or as --threads "
                                    "gave them.", registry=r)
        self._tuned_prefetch = Gauge("feeder_tuned_prefetch", "Pipeline runs in flight each open stream has, as "
                                     "the tuner set them (--prefetch not given).", ["stream"], registry=r)
        self.stream_consumer_wait = Gauge(
            "feeder_stream_consumer_wait_seconds", "Seconds each open stream's ready batches have waited for its "
            "consumer since the stream opened: its producer held by a full ready queue or by a ring whose slots "
            "are all lent (queued, being sent or held by the client). High: the daemon is ahead.", ["stream"],
            registry=r,
        )
        self.stream_starved = Gauge(
            "feeder_stream_starved_seconds", "Seconds each open stream's consumer has waited for a batch the "
            "daemon was still making since the stream opened (not while the daemon waited for the consumer's "
            "slots). High: the consumer waits on the daemon.", ["stream"], registry=r,
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

    def stream_opened(self) -> None:
        self.ledger.add({"open_streams": 1, "streams_opened": 1})

    def stream_closed(self) -> None:
        self.ledger.add({"open_streams": -1})

    def batch_queued(self, nbytes: int) -> None:
        """A ready batch of ``nbytes`` image bytes entered a stream's queue."""
        self._queued.inc()
        self._queued_bytes.inc(nbytes)

    def batch_dequeued(self, nbytes: int) -> None:
        """A ready batch of ``nbytes`` image bytes left a stream's queue (sent or dropped)."""
        self._queued.dec()
        self._queued_bytes.dec(nbytes)

    def memory_budget_set(self, budget_bytes: int) -> None:
        """The ``--max-memory-bytes`` budget the open streams are admitted against."""
        self._memory_budget.set(budget_bytes)

    def memory_reserved(self, reserved_bytes: int) -> None:
        """What the open streams are estimated to hold now."""
        self._reserved.set(reserved_bytes)

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
        self.ledger.add({"images_served": images, "batches_served": 1, "bytes_sent": nbytes})

    def error(self, kind: str) -> None:
        self.ledger.add({"errors": 1}, kind=kind)

    def samples_skipped(self, count: int) -> None:
        self.ledger.add({"samples_skipped": count})

    def samples_failed(self, dataset: str, split: str, count: int) -> None:
        """``count`` samples of a batch were replaced (``--on-error skip``)."""
        self.ledger.add({"samples_failed": count}, dataset=dataset, split=split)

    def bad_sample_found(self, name: str) -> None:
        """A sample found bad for the first time (``dataset/split/key: reason``)."""
        with self._lock:
            self._failed_names.append(name)

    def pipelines_held(self, count: int) -> None:
        """Pipelines built and not yet dropped, now."""
        self.ledger.set({"pipelines": count})

    def gpu_batches(self, count: int, via_host: int) -> None:
        """``count`` batches decoded on a GPU, ``via_host`` of them copied to host memory."""
        self.ledger.add({"gpu_batches": count - via_host}, to="device")
        self.ledger.add({"gpu_host_copies": via_host})

    def decoded_early(self, count: int) -> None:
        """``count`` slow samples started decoding ahead of their batches."""
        self.ledger.add({"samples_decoded_early": count})

    def decode_retried(self) -> None:
        self.retries.inc()

    def stream_usage(self, stream: str, threads: float, queue_fill: float, consumer_wait_s: float,
                     starved_s: float = 0.0, cpu_s: float = 0.0) -> None:
        """What open stream ``stream`` uses now (see the ``feeder_stream_*`` gauges)."""
        self.stream_threads.labels(stream=stream).set(threads)
        self.stream_cpu.labels(stream=stream).set(cpu_s)
        self.stream_queue_fill.labels(stream=stream).set(queue_fill)
        self.stream_consumer_wait.labels(stream=stream).set(consumer_wait_s)
        self.stream_starved.labels(stream=stream).set(starved_s)

    def tuned_threads(self, threads: int) -> None:
        self._tuned_threads.set(threads)

    def tuned_prefetch(self, stream: str, runs: int) -> None:
        self._tuned_prefetch.labels(stream=stream).set(runs)

    def stream_gone(self, stream: str) -> None:
        """Stream ``stream`` closed: its gauges go."""
        for gauge in (self.stream_threads, self.stream_queue_fill, self.stream_consumer_wait, self.stream_starved,
                      self.stream_cpu, self._tuned_prefetch):
            try:
                gauge.remove(stream)
            except KeyError:
                pass  # never reported

    def decoded_cache(self, usage: CacheUsage, hits: int = 0, misses: int = 0, bypassed: int = 0) -> None:
        """Samples a batch found, missed or bypassed in the decoded cache, and what it
        holds now."""
        self.ledger.add({"decoded_cache_hits": hits, "decoded_cache_misses": misses,
                         "decoded_cache_bypassed": bypassed})
        self.ledger.set({"decoded_cache_entries": usage.entries, "decoded_cache_bytes": usage.used_bytes,
                         "decoded_cache_budget_bytes": usage.budget_bytes})

    def watch_remote(self, counters: StoreCounters, cache: ShardCache | None) -> None:
        """Report the object stores' counters and the shard cache (``GetStats``, and
        the ``feeder_store_*`` and ``feeder_shard_cache_*`` metrics)."""
        self.ledger.read_from(lambda: _remote_totals(counters, cache))

    def stage(self, name: str, seconds: float) -> None:
        self.stage_s.labels(stage=name).observe(seconds)

    def stats(self) -> Stats:
        with self._lock:
            failed_names = tuple(self._failed_names)
        return Stats(self.ledger.values(), failed_names)
