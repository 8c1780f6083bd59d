"""The daemon's statistics, declared once: one row per statistic, its Prometheus
family, and whether ``GetStats`` reports it.

``TOTALS`` are what ``GetStats`` reports, each under the name of its field in the
``StatsResponse`` (the public name); ``FAMILIES`` are what Prometheus alone shows (the
state of queues, budgets, each open stream and job, stage times). :class:`feeder.ledger.Ledger`
keeps the values of both and exports them. Adding a statistic is a row here (and,
for a total, its field in ``protos/feeder.proto``), and the call that counts it:
``metrics.ledger.add({name: amount})`` or ``.set(...)``.

A row's Prometheus family is ``feeder_<name>`` unless the row names another one:
older families keep their names (dashboards read them), and several rows may share
one family under fixed labels (``feeder_decoded_cache_samples{outcome="hit"}``). A
row's value is the sum of its family's samples that carry the row's labels, so a
family broken down by free labels (``feeder_errors_total{kind}``) sums to the total.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = ["FAMILIES", "ROWS", "TOTALS", "Kind", "Total"]

Kind = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class Total:
    """One statistic of the daemon.

    Attributes:
        name: its ``StatsResponse`` field, :class:`Stats` attribute and ledger key.
        kind: ``counter`` (only grows), ``gauge`` (a value now) or ``histogram``
            (observations, by ``buckets``).
        unit: what it counts (``seconds`` makes it a float, all others integers).
        help: the Prometheus help text.
        metric: its Prometheus family where that is not ``feeder_<name>``.
        labels: the fixed labels of its samples in a family it shares.
        by: free labels its family breaks it down by (summed here).
        in_stats: whether ``GetStats`` reports it (a ``StatsResponse`` field); the
            others are Prometheus families only.
        buckets: a histogram's upper bounds (``kind`` ``histogram``).
    """

    name: str
    kind: Kind
    unit: str
    help: str
    metric: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    by: tuple[str, ...] = ()
    in_stats: bool = True
    buckets: tuple[float, ...] = ()

    @property
    def family(self) -> str:
        """Its Prometheus family (counters get ``_total`` appended by Prometheus)."""
        return self.metric or f"feeder_{self.name}"

    @property
    def integral(self) -> bool:
        """Whether it is a count (an ``int64`` field) rather than seconds."""
        return self.unit != "seconds"


# Help texts of families that several rows share.
_GPU = ("Batches decoded on a GPU, by where they went: 'device' (straight into the client's CUDA IPC slot) "
        "or 'host' (copied through host memory).")
_DECODED = ("Samples by what the decoded cache did: hit, miss (decoded from JPEG), bypassed (image size above "
            "the cached side).")
_SHARD = "Samples of remote datasets by where they were read: hit (the node-local copy), miss (ranged GETs)."
_HIT, _MISS = {"outcome": "hit"}, {"outcome": "miss"}

TOTALS: tuple[Total, ...] = (
    Total("images_served", "counter", "images", "Images sent to clients.", metric="feeder_images"),
    Total("batches_served", "counter", "batches", "Batches sent to clients.", metric="feeder_batches"),
    Total("bytes_sent", "counter", "bytes", "Image bytes sent to clients."),
    Total("open_streams", "gauge", "streams", "Streams open now."),
    Total("streams_opened", "counter", "streams", "Streams opened since the daemon started."),
    Total("errors", "counter", "streams", "Streams ended by an error.", by=("kind",)),
    Total("uptime_s", "gauge", "seconds", "Seconds since the daemon started.", metric="feeder_uptime_seconds"),
    Total("samples_skipped", "counter", "samples", "Samples skipped by the drop policy."),
    Total("samples_failed", "counter", "samples", "Samples that could not be served (undecodable or over "
          "--max-pixels) and were replaced by a repeat of another sample.", by=("dataset", "split")),
    Total("samples_decoded_early", "counter", "samples", "Slow samples (windows many times their batch's median "
          "area) whose decoding started ahead of their batch (--lookahead)."),
    Total("pipelines", "gauge", "pipelines", "Built pipelines, lent to streams or idle."),
    Total("gpu_batches", "counter", "batches", _GPU, by=("to",)),
    Total("gpu_host_copies", "counter", "batches", _GPU, metric="feeder_gpu_batches", labels={"to": "host"}),
    Total("decoded_cache_hits", "counter", "samples", _DECODED, metric="feeder_decoded_cache_samples", labels=_HIT),
    Total("decoded_cache_misses", "counter", "samples", _DECODED, metric="feeder_decoded_cache_samples",
          labels=_MISS),
    Total("decoded_cache_bypassed", "counter", "samples", _DECODED, metric="feeder_decoded_cache_samples",
          labels={"outcome": "bypassed"}),
    Total("decoded_cache_entries", "gauge", "images", "Images in the decoded cache."),
    Total("decoded_cache_bytes", "gauge", "bytes", "Bytes the decoded cache holds."),
    Total("decoded_cache_budget_bytes", "gauge", "bytes", "Decoded cache budget."),
    Total("store_requests", "counter", "requests", "Requests made to object stores (ranged GETs, downloads, "
          "lists)."),
    Total("store_retries", "counter", "requests", "Requests to object stores retried after a transient failure."),
    Total("store_failures", "counter", "requests", "Requests to object stores that failed for good, or gave up."),
    Total("store_bytes_fetched", "counter", "bytes", "Bytes read from (or written to) object stores."),
    Total("shard_cache_hits", "counter", "samples", _SHARD, metric="feeder_shard_cache_samples", labels=_HIT),
    Total("shard_cache_misses", "counter", "samples", _SHARD, metric="feeder_shard_cache_samples", labels=_MISS),
    Total("shard_cache_downloads", "counter", "shards", "Shards fetched whole and cached."),
    Total("shard_cache_download_failures", "counter", "shards", "Shard downloads that failed (their samples "
          "read with ranged GETs)."),
    Total("shard_cache_evictions", "counter", "shards", "Cached shards evicted past --cache-bytes."),
    Total("shard_cache_shards", "gauge", "shards", "Shards in the node-local cache."),
    Total("shard_cache_bytes", "gauge", "bytes", "Bytes of shards in the node-local cache."),
    Total("shard_cache_budget_bytes", "gauge", "bytes", "The shard cache's budget (--cache-bytes; lowered to "
          "what it holds when its disk is full)."),
)


_STAGE_BUCKETS_S = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 10)
_JOB, _STREAM = ("job",), ("stream",)


def _family(name: str, kind: Kind, unit: str, text: str, **options: Any) -> Total:
    """A row Prometheus shows and ``GetStats`` does not report (``text``: its help)."""
    return Total(name, kind, unit, text, in_stats=False, **options)


# The Prometheus families beyond GetStats: how the daemon works now (queues, budgets,
# refusals, each open stream and job, stage times, the tuner's settings).
FAMILIES: tuple[Total, ...] = (
    _family("decode_retries", "counter", "runs", "Pipeline runs repeated after samples failed to decode."),
    _family("queued_batches", "gauge", "batches", "Ready batches waiting in stream queues."),
    _family("queued_bytes", "gauge", "bytes", "Bytes of ready batches in stream queues."),
    _family("reserved_bytes", "gauge", "bytes", "Estimated memory of the open streams (see --max-memory-bytes)."),
    _family("memory_budget_bytes", "gauge", "bytes", "The --max-memory-bytes budget."),
    _family("streams_refused", "counter", "streams", "Streams refused by a limit.", by=("reason",)),
    _family("unauthenticated", "counter", "calls", "Calls refused for a missing or wrong token."),
    _family("waiting_calls", "gauge", "calls", "Calls waiting for their request message now (see "
            "--max-waiting-calls)."),
    _family("calls_refused", "counter", "calls", "Calls ended before their handler ran: 'waiting' (cancelled after "
            "the longest wait, to let a newer call wait past --max-waiting-calls), 'timeout' (no request message "
            "within --first-message-timeout-s), 'malformed' (not a valid request message).", by=("reason",)),
    _family("metrics_scrapes_refused", "counter", "connections", "Metrics connections not served: 'token' (missing "
            "or wrong), 'busy' (too many connections pending).", by=("reason",)),
    _family("streams_idle_cancelled", "counter", "streams", "Streams cancelled after --idle-timeout-s unread."),
    _family("stream_threads", "gauge", "threads", "Decode threads each open stream kept busy over the last "
            "interval: its share of --threads (DALI's own threads not counted).", by=_STREAM),
    _family("stream_queue_fill", "gauge", "shares", "Share of each open stream's ready queue that is filled (near 1: "
            "its consumer is the slow side; near 0: it waits for the daemon).", by=_STREAM),
    _family("stream_cpu_s", "gauge", "seconds", "CPU seconds each open stream's decodes and resizes have taken on "
            "the decode threads since the stream opened.", metric="feeder_stream_cpu_seconds", by=_STREAM),
    _family("stream_consumer_wait_s", "gauge", "seconds", "Seconds each open stream's ready batches have waited for "
            "its consumer since the stream opened: its producer held by a full ready queue or by a ring whose slots "
            "are all lent (queued, being sent or held by the client). High: the daemon is ahead.",
            metric="feeder_stream_consumer_wait_seconds", by=_STREAM),
    _family("stream_starved_s", "gauge", "seconds", "Seconds each open stream's consumer has waited for a batch the "
            "daemon was still making since the stream opened (not while the daemon waited for the consumer's "
            "slots). High: the consumer waits on the daemon.", metric="feeder_stream_starved_seconds", by=_STREAM),
    _family("tuned_threads", "gauge", "threads", "Decode threads: as the tuner set them, or as --threads gave "
            "them."),
    _family("tuned_prefetch", "gauge", "runs", "Pipeline runs in flight each open stream has, as the tuner set "
            "them (--prefetch not given).", by=_STREAM),
    _family("job_streams", "gauge", "streams", "Streams each job has open.", by=_JOB),
    _family("job_threads", "gauge", "threads", "Decode threads each job's streams kept busy over the last "
            "interval: its share of --threads (see --fair-share).", by=_JOB),
    _family("job_decode_s", "counter", "seconds", "Seconds of the decode threads each job's streams have taken "
            "(wall time on the workers, what --fair-share shares).", metric="feeder_job_decode_seconds", by=_JOB),
    _family("job_cpu_s", "counter", "seconds", "CPU seconds of the decode threads each job's streams have taken.",
            metric="feeder_job_cpu_seconds", by=_JOB),
    _family("job_images", "counter", "images", "Images sent to each job's streams.", by=_JOB),
    _family("job_images_per_s", "gauge", "images", "Images per second sent to each job's streams over the last "
            "interval.", metric="feeder_job_images_per_second", by=_JOB),
    _family("stage_s", "histogram", "seconds", "Seconds per batch in each stage.", metric="feeder_stage_seconds",
            by=("stage",), buckets=_STAGE_BUCKETS_S),
)

ROWS: tuple[Total, ...] = TOTALS + FAMILIES
