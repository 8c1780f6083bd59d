"""The daemon's statistics, declared once.

``TOTALS`` is the table: one row per statistic, under the name of its field in the
``StatsResponse`` of ``GetStats`` (the public name). From it the :class:`Ledger`
keeps the values, exports them to Prometheus and builds the :class:`Stats` record the
servicer turns into a ``StatsResponse`` field by field. Adding a statistic is a row
here, its field in ``protos/feeder.proto``, and the call that counts it.

A row's Prometheus family is ``feeder_<name>`` unless the row names another one:
older families keep their names (dashboards read them), and several rows may share
one family under fixed labels (``feeder_decoded_cache_samples{outcome="hit"}``). A
row's value is the sum of its family's samples that carry the row's labels, so a
family broken down by free labels (``feeder_errors_total{kind}``) sums to the total.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Literal

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

__all__ = ["TOTALS", "Ledger", "Stats", "Total"]

Kind = Literal["counter", "gauge"]


@dataclass(frozen=True)
class Total:
    """One statistic of the daemon.

    Attributes:
        name: its ``StatsResponse`` field, :class:`Stats` attribute and ledger key.
        kind: ``counter`` (only grows) or ``gauge`` (a value now).
        unit: what it counts (``seconds`` makes it a float, all others integers).
        help: the Prometheus help text.
        metric: its Prometheus family where that is not ``feeder_<name>``.
        labels: the fixed labels of its samples in a family it shares.
        by: free labels its family breaks it down by (summed here).
    """

    name: str
    kind: Kind
    unit: str
    help: str
    metric: str = ""
    labels: Mapping[str, str] = field(default_factory=dict)
    by: tuple[str, ...] = ()

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


@dataclass(frozen=True)
class _Family:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]


def _families(totals: tuple[Total, ...]) -> dict[str, _Family]:
    """The Prometheus families of ``totals``, with the label names of all their rows."""
    rows: dict[str, list[Total]] = {}
    for total in totals:
        rows.setdefault(total.family, []).append(total)
    families = {}
    for name, group in rows.items():
        if len({t.kind for t in group}) != 1:
            raise ValueError(f"the rows of {name} mix counters and gauges: {[t.name for t in group]}")
        labels = tuple(dict.fromkeys(label for t in group for label in (*t.by, *t.labels)))
        text = " ".join(dict.fromkeys(t.help for t in group))
        families[name] = _Family(name, group[0].kind, text, labels)
    return families


Source = Callable[[], Mapping[str, float]]


class Ledger:
    """The values of ``TOTALS``, thread-safe; a Prometheus collector of them.

    Values are kept per family sample (a tuple of label values). A row that fixes
    every label of its family is 0 from the start (exported before it is counted);
    the others appear with their first labels.
    """

    def __init__(self, totals: tuple[Total, ...] = TOTALS) -> None:
        self.totals = {t.name: t for t in totals}
        self._families = _families(totals)
        self._samples: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in self._families}
        self._sources: list[Source] = []
        self._lock = threading.Lock()
        for total in totals:
            family = self._families[total.family]
            if set(total.labels) == set(family.labels):
                self._samples[family.name][self._key(total, {})] = 0.0

    def _key(self, total: Total, labels: Mapping[str, str]) -> tuple[str, ...]:
        given = {**total.labels, **labels}
        family = self._families[total.family]
        if set(given) != set(family.labels):
            raise ValueError(f"{total.name} is counted with labels {sorted(family.labels)}, not {sorted(given)}")
        return tuple(given[label] for label in family.labels)

    def add(self, amounts: Mapping[str, float], **labels: str) -> None:
        """Add each amount to its total (at ``labels``, the row's free labels), at once."""
        with self._lock:
            for name, amount in amounts.items():
                total = self.totals[name]
                samples = self._samples[total.family]
                key = self._key(total, labels)
                samples[key] = samples.get(key, 0.0) + amount

    def set(self, values: Mapping[str, float], **labels: str) -> None:
        """Set each total to its value now (at ``labels``), at once."""
        with self._lock:
            for name, value in values.items():
                total = self.totals[name]
                self._samples[total.family][self._key(total, labels)] = value

    def read_from(self, source: Source) -> None:
        """Totals kept elsewhere (an object store's counters, a clock): ``source()``
        gives them by name, read each time the ledger is read."""
        self._sources.append(source)

    def _read_sources(self) -> None:
        for source in self._sources:
            self.set(source())

    def values(self) -> dict[str, float]:
        """Every total by name: integers, seconds as floats."""
        self._read_sources()
        with self._lock:
            return {name: self._value(total) for name, total in self.totals.items()}

    def _value(self, total: Total) -> float:
        family = self._families[total.family]
        where = [(family.labels.index(label), value) for label, value in total.labels.items()]
        found = sum(v for key, v in self._samples[family.name].items() if all(key[i] == want for i, want in where))
        return int(found) if total.integral else found

    def describe(self) -> list[Metric]:
        return []  # collected on each scrape, not at registration

    def collect(self) -> Iterator[Metric]:
        """The families for a Prometheus scrape."""
        self._read_sources()
        with self._lock:
            samples = {name: dict(values) for name, values in self._samples.items()}
        for name, family in self._families.items():
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = kind(name, family.help, labels=list(family.labels))
            for key, value in samples[name].items():
                metric.add_metric(list(key), value)
            yield metric


@dataclass(frozen=True)
class Stats:
    """Totals since the daemon started (``GetStats``): each row of ``TOTALS`` as an
    attribute of its name (``stats.images_served``), and the latest bad samples."""

    totals: Mapping[str, float]
    failed_keys: tuple[str, ...] = ()

    def __getattr__(self, name: str) -> float:
        totals = self.__dict__.get("totals", {})
        if name not in totals:
            raise AttributeError(f"{type(self).__name__} has no total {name!r}")
        return totals[name]

    def fields(self) -> dict[str, object]:
        """The ``StatsResponse`` fields, by name."""
        return {**self.totals, "failed_keys": list(self.failed_keys)}
