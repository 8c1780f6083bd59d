"""``python -m tests.chaos --seeds N`` (``make chaos SEEDS=N``): run N fault schedules
(seeds 1..N, or ``--seed-list``), print one line per seed and the figures, write them
all as JSON. Exit 1 when any schedule lost, repeated or changed a sample."""

from __future__ import annotations

import argparse
import json
import signal
import sys
import tempfile
from pathlib import Path

from tests.chaos.run import Outcome, RunConfig, run


def _line(outcome: Outcome) -> str:
    waits = max((r["longest_wait_outside_store_faults_s"] for r in outcome.ranks), default=0.0)
    back = max((r["first_batch_after_store_back_s"] for r in outcome.ranks), default=0.0)
    kinds = ", ".join(f"{f['kind'].lower()} {f['longest_wait_s']:.2f}" for f in outcome.faults)
    verdict = "ok" if outcome.ok else "FAILED: " + "; ".join(outcome.problems[:3])
    data = "mix of 2 (store + local)" if outcome.mixed else "1 dataset (store)"
    return (f"seed {outcome.seed:3d}: {verdict} | {data} | {outcome.epochs} epochs | faults (longest wait after "
            f"each, s): {kinds} | longest wait outside store faults {waits:.2f} s | first batch after the store was "
            f"back {back:.2f} s | {outcome.seconds:.0f} s")


def _stopped(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # the runs' context managers stop their daemons, ranks and store


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _stopped)
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3, help="run seeds 1..N")
    parser.add_argument("--seed-list", default="", help="comma-separated seeds instead of 1..N")
    parser.add_argument("--faults", type=int, default=6, help="faults per schedule")
    parser.add_argument("--quick", action="store_true", help="short faults (the test suite's)")
    parser.add_argument("--json", type=Path, default=None, help="write every outcome here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep each run's files here")
    args = parser.parse_args(argv)
    seeds = [int(s) for s in args.seed_list.split(",") if s] or list(range(1, args.seeds + 1))
    outcomes = []
    with tempfile.TemporaryDirectory(prefix="feeder-chaos-") as tmp:
        root = args.workdir or Path(tmp)
        for seed in seeds:
            outcome = run(RunConfig(seed=seed, workdir=root / f"seed-{seed}", faults=args.faults, quick=args.quick))
            outcomes.append(outcome)
            print(_line(outcome), flush=True)
            if args.json is not None:  # after each seed: a run stopped part-way keeps the seeds it finished
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps([o.to_dict() for o in outcomes], indent=1) + "\n")
    failed = [o.seed for o in outcomes if not o.ok]
    mixed = sum(o.mixed for o in outcomes)
    print(f"{len(outcomes) - len(failed)} of {len(outcomes)} schedules ({mixed} of them a mix) kept every sample "
          "exactly once" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
