"""The daemon's statistics, driven from their one table (feeder.statistics): every
total reaches Stats, GetStats' StatsResponse and the Prometheus registry under its name,
every other row Prometheus alone, and no family is declared anywhere else; over a real
in-process daemon on port 0."""

from __future__ import annotations

import pytest
from google.protobuf.descriptor import FieldDescriptor

from feeder.ledger import Ledger
from feeder.statistics import FAMILIES, ROWS, TOTALS, Total
from protos import feeder_pb2, feeder_pb2_grpc
from tests.common.waiting import wait_for
from tests.feeder.conftest import connect, request

NOT_TOTALS = {"failed_keys"}  # StatsResponse fields that are no row of the table (a list of names)
_TYPES = {True: FieldDescriptor.TYPE_INT64, False: FieldDescriptor.TYPE_DOUBLE}


def _missing_places(totals: tuple[Total, ...]) -> list[str]:
    """What adding a statistic left undone, naming the place to touch."""
    fields = feeder_pb2.StatsResponse.DESCRIPTOR.fields_by_name
    rows = {t.name: t for t in totals}
    problems = [f"{name}: a TOTALS row without its StatsResponse field (protos/feeder.proto)"
                for name in rows if name not in fields]
    problems += [f"{name}: a StatsResponse field without its TOTALS row (feeder/statistics.py)"
                 for name in fields if name not in rows and name not in NOT_TOTALS]
    problems += [f"{name}: StatsResponse type {fields[name].type}, its unit {t.unit!r} wants {_TYPES[t.integral]}"
                 for name, t in rows.items() if name in fields and fields[name].type != _TYPES[t.integral]]
    return problems


def _prometheus(registry, total: Total) -> float | None:
    """The sum of ``total``'s family samples that carry its labels, as scraped (None:
    no such family; 0: a family broken down by labels none of which came yet)."""
    families = [family for family in registry.collect() if family.name == total.family]
    if [family.type for family in families] != [total.kind]:
        return None
    sample = total.family + ("_total" if total.kind == "counter" else "")
    return sum(s.value for s in families[0].samples if s.name == sample and total.labels.items() <= s.labels.items())


def _agree(total: Total, found: tuple[float, float, float | None]) -> bool:
    if total.integral:
        return found[0] == found[1] == found[2]
    # Seconds run on between the reads: they may only grow, in the order read.
    return found[2] is not None and found[0] <= found[1] <= found[2]


def _three_places(server, port: int) -> list[str]:
    """Each row in Stats, then GetStats, then the registry: where they disagree."""
    stats = server.metrics.stats()
    with connect(port) as channel:
        response = feeder_pb2_grpc.FeederStub(channel).GetStats(feeder_pb2.StatsRequest(), timeout=10)
    problems = []
    for total in TOTALS:
        found = (getattr(stats, total.name), getattr(response, total.name),
                 _prometheus(server.metrics.registry, total))
        if not _agree(total, found):
            labels = dict(total.labels) or ""
            problems.append(f"{total.name}: Stats {found[0]}, StatsResponse {found[1]}, "
                            f"Prometheus {total.family}{labels} {found[2]}")
    return problems


def test_every_row_has_its_proto_field_and_every_field_its_row():
    assert _missing_places(TOTALS) == []


def test_a_row_without_its_proto_field_is_named_with_the_file_to_touch():
    extra = Total("images_dropped", "counter", "images", "Images dropped.")
    assert _missing_places((*TOTALS, extra)) == [
        "images_dropped: a TOTALS row without its StatsResponse field (protos/feeder.proto)"
    ]
    assert _missing_places(TOTALS[1:]) == [
        "images_served: a StatsResponse field without its TOTALS row (feeder/statistics.py)"
    ]


def test_every_row_reaches_stats_getstats_and_prometheus_under_its_name(private_server):
    server, port = private_server()
    for i, total in enumerate(TOTALS):  # distinct amounts: a row read through another's family or labels shows
        server.metrics.ledger.add({total.name: 1000 + 7 * i}, **{label: "test" for label in total.by})
    assert _three_places(server, port) == []
    stats = server.metrics.stats()
    assert [t.name for t in TOTALS if not getattr(stats, t.name)] == [], "every row was counted"
    names = [family.name for family in server.metrics.registry.collect()]
    assert len(names) == len(set(names)), "a TOTALS family is declared again beside the table"


def test_a_served_stream_is_counted_alike_in_the_three_places(private_server):
    server, port = private_server()
    with connect(port) as channel:
        batches = list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request(batch_size=4, max_samples=8)))
    assert len(batches) == 2
    assert wait_for(lambda: server.metrics.stats().open_streams == 0)
    assert _three_places(server, port) == []
    stats = server.metrics.stats()
    assert (stats.images_served, stats.batches_served, stats.streams_opened) == (8, 2, 1)
    assert stats.bytes_sent == 8 * 16 * 16 * 3
    value = server.metrics.registry.get_sample_value
    assert (value("feeder_queued_batches"), value("feeder_queued_bytes")) == (0, 0), "a batch queued was never taken"


def test_a_total_counted_without_its_labels_is_refused_by_name():
    ledger = Ledger()
    with pytest.raises(ValueError, match="errors is counted with labels"):
        ledger.add({"errors": 1})
    with pytest.raises(KeyError):
        ledger.add({"images_dropped": 1})


def test_rows_sharing_a_family_must_agree_on_its_kind():
    rows = (Total("a_hits", "counter", "samples", "A.", metric="feeder_a", labels={"outcome": "hit"}),
            Total("a_held", "gauge", "samples", "A.", metric="feeder_a", labels={"outcome": "held"}))
    with pytest.raises(ValueError, match="feeder_a mix kinds"):
        Ledger(rows)


def test_every_family_the_daemon_exports_is_a_row_of_the_table(private_server):
    server, _ = private_server()
    server.metrics.stage("decode", 0.003)  # a histogram appears with its first labels
    exported = {family.name for family in server.metrics.registry.collect()}
    assert exported == {row.family for row in ROWS}
    assert not {row.name for row in FAMILIES} & set(feeder_pb2.StatsResponse.DESCRIPTOR.fields_by_name)
    assert set(server.metrics.stats().totals) == {row.name for row in TOTALS}


def test_a_histogram_counts_each_observation_in_its_buckets_and_sum():
    ledger = Ledger((Total("wait_s", "histogram", "seconds", "Waits.", by=("stage",), buckets=(0.1, 1.0),
                           in_stats=False),))
    for seconds in (0.05, 0.5, 5.0):
        ledger.observe("wait_s", seconds, stage="read")
    (family,) = ledger.collect()
    samples = {(s.name, s.labels.get("le")): s.value for s in family.samples}
    assert samples == {("feeder_wait_s_bucket", "0.1"): 1, ("feeder_wait_s_bucket", "1.0"): 2,
                       ("feeder_wait_s_bucket", "+Inf"): 3, ("feeder_wait_s_count", None): 3,
                       ("feeder_wait_s_sum", None): 5.55}


def test_a_stream_or_job_gone_takes_its_samples_and_no_others():
    ledger = Ledger()
    ledger.set({"stream_threads": 1.5, "tuned_prefetch": 3}, stream="7")
    ledger.set({"stream_threads": 2.0}, stream="8")
    ledger.observe("stage_s", 0.01, stage="7")  # another label of the same value stays
    ledger.forget("stream", "7")
    kept = {(s.name, tuple(sorted(s.labels.items()))) for family in ledger.collect() for s in family.samples
            if s.labels and "le" not in s.labels}
    assert ("feeder_stream_threads", (("stream", "8"),)) in kept
    assert not [labels for _, labels in kept if ("stream", "7") in labels]
    assert ("feeder_stage_seconds_sum", (("stage", "7"),)) in kept
