"""The values of the daemon's statistics (:mod:`feeder.statistics`, the one table of
them), kept thread-safe, exported to Prometheus as one collector, and read back as
the :class:`Stats` record the servicer turns into a ``StatsResponse`` field by field."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from feeder.statistics import ROWS, Kind, Total

__all__ = ["Ledger", "Stats"]


@dataclass(frozen=True)
class _Family:
    name: str
    kind: Kind
    help: str
    labels: tuple[str, ...]
    buckets: tuple[float, ...] = ()


def _families(totals: tuple[Total, ...]) -> dict[str, _Family]:
    """The Prometheus families of ``totals``, with the label names of all their rows."""
    rows: dict[str, list[Total]] = {}
    for total in totals:
        rows.setdefault(total.family, []).append(total)
    families = {}
    for name, group in rows.items():
        if len({t.kind for t in group}) != 1:
            raise ValueError(f"the rows of {name} mix kinds: {[t.name for t in group]}")
        labels = tuple(dict.fromkeys(label for t in group for label in (*t.by, *t.labels)))
        text = " ".join(dict.fromkeys(t.help for t in group))
        families[name] = _Family(name, group[0].kind, text, labels, group[0].buckets)
    return families


Source = Callable[[], Mapping[str, float]]


class Ledger:
    """The values of the rows of :mod:`feeder.statistics`, thread-safe; a Prometheus
    collector of them.

    Values are kept per family sample (a tuple of label values); a histogram's as its
    bucket counts and sum. A row that fixes every label of its family is 0 from the
    start (exported before it is counted); the others appear with their first labels.
    """

    def __init__(self, totals: tuple[Total, ...] = ROWS) -> None:
        self.totals = {t.name: t for t in totals}
        self._families = _families(totals)
        self._samples: dict[str, dict[tuple[str, ...], float]] = {name: {} for name in self._families}
        self._observed: dict[str, dict[tuple[str, ...], list[float]]] = {name: {} for name in self._families}
        self._sources: list[Source] = []
        self._lock = threading.Lock()
        for total in totals:
            family = self._families[total.family]
            if set(total.labels) == set(family.labels) and family.kind != "histogram":
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

    def observe(self, name: str, value: float, **labels: str) -> None:
        """One observation of the histogram ``name`` (at ``labels``)."""
        total = self.totals[name]
        family = self._families[total.family]
        with self._lock:
            counts = self._observed[family.name].setdefault(self._key(total, labels), [0.0] * (len(family.buckets) + 2))
            for i, bound in enumerate(family.buckets):
                if value <= bound:
                    counts[i] += 1
            counts[-2] += 1  # +Inf: every observation
            counts[-1] += value  # the sum

    def forget(self, label: str, value: str) -> None:
        """Drop every sample whose ``label`` is ``value`` (a stream or a job gone)."""
        with self._lock:
            for family in self._families.values():
                if label in family.labels:
                    at = family.labels.index(label)
                    for values in (self._samples[family.name], self._observed[family.name]):
                        for key in [key for key in values if key[at] == value]:
                            del values[key]

    def read_from(self, source: Source) -> None:
        """Totals kept elsewhere (an object store's counters, a clock): ``source()``
        gives them by name, read each time the ledger is read."""
        self._sources.append(source)

    def _read_sources(self) -> None:
        for source in self._sources:
            self.set(source())

    def values(self) -> dict[str, float]:
        """Every total ``GetStats`` reports, by name: integers, seconds as floats."""
        self._read_sources()
        with self._lock:
            return {name: self._value(total) for name, total in self.totals.items() if total.in_stats}

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
            observed = {name: {key: list(counts) for key, counts in values.items()}
                        for name, values in self._observed.items()}
        for name, family in self._families.items():
            if family.kind == "histogram":
                yield _histogram(family, observed[name])
                continue
            kind = CounterMetricFamily if family.kind == "counter" else GaugeMetricFamily
            metric = kind(name, family.help, labels=list(family.labels))
            for key, value in samples[name].items():
                metric.add_metric(list(key), value)
            yield metric


def _histogram(family: _Family, observed: Mapping[tuple[str, ...], list[float]]) -> Metric:
    metric = HistogramMetricFamily(family.name, family.help, labels=list(family.labels))
    bounds = [*(floatToGoString(bound) for bound in family.buckets), "+Inf"]
    for key, counts in observed.items():
        metric.add_metric(list(key), list(zip(bounds, counts[:-1], strict=True)), counts[-1])
    return metric


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
