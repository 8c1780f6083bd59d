"""``bench/autotune.py``'s parts: the rate over a window from the clients' records,
and one real run of a daemon with two jobs' client processes. Speed is measured by
running the benchmark, never asserted here."""

from __future__ import annotations

from pathlib import Path

import pytest

from bench import autotune


def test_the_rate_over_a_window_counts_what_each_client_took_by_its_ends() -> None:
    one = ([0.0, 1.0, 2.0, 3.0], [0, 10, 20, 30])
    other = ([0.0, 1.5, 2.5], [0, 100, 200])
    # At 1.0: 10 + 0; at 3.0: 30 + 200.
    assert autotune.rate_between([one, other], 1.0, 3.0) == pytest.approx((20 + 200) / 2.0)
    assert autotune.rate_between([one], 0.5, 0.9) == 0.0  # no batch came in it


def test_each_scenario_runs_one_client_per_rank_of_each_job() -> None:
    assert autotune.SCENARIOS["ranks-4"].clients == [(0, 0), (1, 0), (2, 0), (3, 0)]
    assert autotune.SCENARIOS["jobs-2"].clients == [(0, 0), (0, 1)]


@pytest.mark.slow
def test_a_run_opens_every_clients_stream_and_brings_back_their_records(bench_shards: Path) -> None:
    args = autotune.parse_args(["--seconds", "1"])
    scenario = autotune.Scenario(image_size=32, batch_size=8, jobs=2)
    records, _ = autotune._run(bench_shards, scenario, ("--threads", "1", "--prefetch", "1"), 1.5, args)
    assert len(records) == 2
    for times, counts in records:
        assert times[-1] >= 1.5 and counts[-1] > 0 and counts == sorted(counts)
    assert autotune.rate_between(records, 0.0, 1.5) > 0
