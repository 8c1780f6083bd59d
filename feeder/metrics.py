"""Counters of one daemon: exported to Prometheus (a registry per server, so several
servers in one process do not collide). Every statistic and Prometheus family is
declared once, in :mod:`feeder.statistics`, and kept by the :class:`Ledger`; the
methods here name what the daemon's parts count, each a call into the ledger."""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from feeder.ledger import Ledger, Stats

if TYPE_CHECKING:
    from decode.decoded_cache import CacheUsage
    from shards.shard_cache import ShardCache
    from shards.store import StoreCounters

__all__ = ["ServerMetrics", "Stats"]

_FAILED_NAMED = 16  # bad samples GetStats names (the latest found)


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
    """Thread-safe counters, exported through a private Prometheus registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self._started_s = time.monotonic()
        self._lock = threading.Lock()
        self._failed_names: deque[str] = deque(maxlen=_FAILED_NAMED)
        self.ledger = Ledger()  # every row of feeder.statistics, exported under its family
        self.registry.register(self.ledger)
        self.ledger.read_from(lambda: {"uptime_s": time.monotonic() - self._started_s})

    def job_used(self, job: str, decode_s: float, cpu_s: float, images: int) -> None:
        """What job ``job``'s streams took since it was last told."""
        self.ledger.add({"job_decode_s": max(0.0, decode_s), "job_cpu_s": max(0.0, cpu_s), "job_images": images},
                        job=job)

    def job_rates(self, job: str, streams: int, threads: float, images_per_s: float) -> None:
        """What job ``job`` has open and took over the last interval."""
        self.ledger.set({"job_streams": streams, "job_threads": threads, "job_images_per_s": images_per_s}, job=job)

    def job_gone(self, job: str) -> None:
        """Job ``job``'s last stream closed: its labels go."""
        self.ledger.forget("job", job)

    def stream_opened(self) -> None:
        self.ledger.add({"open_streams": 1, "streams_opened": 1})

    def stream_closed(self) -> None:
        self.ledger.add({"open_streams": -1})

    def batch_queued(self, nbytes: int) -> None:
        """A ready batch of ``nbytes`` image bytes entered a stream's queue."""
        self.ledger.add({"queued_batches": 1, "queued_bytes": nbytes})

    def batch_dequeued(self, nbytes: int) -> None:
        """A ready batch of ``nbytes`` image bytes left a stream's queue (sent or dropped)."""
        self.ledger.add({"queued_batches": -1, "queued_bytes": -nbytes})

    def memory_budget_set(self, budget_bytes: int) -> None:
        """The ``--max-memory-bytes`` budget the open streams are admitted against."""
        self.ledger.set({"memory_budget_bytes": budget_bytes})

    def memory_reserved(self, reserved_bytes: int) -> None:
        """What the open streams are estimated to hold now."""
        self.ledger.set({"reserved_bytes": reserved_bytes})

    def stream_refused(self, reason: str) -> None:
        self.ledger.add({"streams_refused": 1}, reason=reason)

    def unauthenticated_call(self) -> None:
        self.ledger.add({"unauthenticated": 1})

    def call_waiting(self, change: int) -> None:
        """A call began (+1) or ended (-1) waiting for its request message."""
        self.ledger.add({"waiting_calls": change})

    def call_refused(self, reason: str) -> None:
        self.ledger.add({"calls_refused": 1}, reason=reason)

    def scrape_refused(self, reason: str) -> None:
        self.ledger.add({"metrics_scrapes_refused": 1}, reason=reason)

    def stream_idle_cancelled(self) -> None:
        self.ledger.add({"streams_idle_cancelled": 1})

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
        self.ledger.add({"decode_retries": 1})

    def stream_usage(self, stream: str, threads: float, queue_fill: float, consumer_wait_s: float,
                     starved_s: float = 0.0, cpu_s: float = 0.0) -> None:
        """What open stream ``stream`` uses now (see the ``feeder_stream_*`` gauges)."""
        self.ledger.set({"stream_threads": threads, "stream_cpu_s": cpu_s, "stream_queue_fill": queue_fill,
                         "stream_consumer_wait_s": consumer_wait_s, "stream_starved_s": starved_s}, stream=stream)

    def tuned_threads(self, threads: int) -> None:
        self.ledger.set({"tuned_threads": threads})

    def tuned_prefetch(self, stream: str, runs: int) -> None:
        self.ledger.set({"tuned_prefetch": runs}, stream=stream)

    def stream_gone(self, stream: str) -> None:
        """Stream ``stream`` closed: its gauges go."""
        self.ledger.forget("stream", stream)

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
        self.ledger.observe("stage_s", seconds, stage=name)

    def stats(self) -> Stats:
        with self._lock:
            failed_names = tuple(self._failed_names)
        return Stats(self.ledger.values(), failed_names)
