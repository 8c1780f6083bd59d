"""Three fixed seeds of the fault schedule (its quick durations): two ranks read a
pool of three daemons over a real S3 server through six faults, each of which is
proved to have happened (its kind's predicate over what was measured while it was
made), and every sample of every epoch arrives exactly once with its own label and
pixels (``make chaos`` runs more seeds, with the durations a cluster makes). Seed 2
streams a mix of the store's dataset and a local one: each sample as often as the
fault-free plan has it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.chaos.run import RunConfig, run

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_seeded_schedule_of_faults_loses_repeats_and_changes_nothing(seed: int, tmp_path: Path) -> None:
    outcome = run(RunConfig(seed=seed, workdir=tmp_path, quick=True))
    made = [f"{f['kind']}: {f['evidence']}" for f in outcome.faults]
    assert outcome.ok, "\n".join(outcome.problems + made)  # each fault landed, every sample as planned
    assert (outcome.extra_samples > 0) == (seed == 2), outcome.extra_samples  # the mix was streamed
