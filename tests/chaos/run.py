"""One fault-schedule run and its checker.

:func:`run` builds the dataset (and another one), reads a fault-free reference of the
plan (one daemon on the local copy, each rank in turn), starts a real S3 server with
both datasets and three daemons reading from it, starts the two ranks
(:mod:`tests.chaos.rank`), makes the schedule's faults one after the other while they
read, and checks what every rank received against the reference
(:func:`check`): every sample of every epoch exactly once, with the reference's label
and pixels; a rank that ended in an error is a failure unless its one line names
the cause of a fault that must end a job (none in a pool of three: the daemon on
another manifest is left, the others serve). Each fault is checked too: what was
measured while it was made must satisfy its kind's predicate
(:func:`tests.chaos.evidence.not_landed`: the exit status of a kill, the state ``T``
while stopped, a counter that went up, an ETag that changed, keys refused), and every
rank must have received a batch before it began and after it ended; a fault that did
not land fails the run, named.

Every other seed (the even ones: at least a third of any run of seeds) streams a mix
instead: the dataset from the store at 0.75 and a second one from each daemon's
local disk at 0.25, an epoch of as many samples as the dataset alone has. The
second dataset is smaller than its share, so its samples come back within an epoch,
pass after pass: the checker then counts each sample as often as the fault-free
reference has it. It also reports the longest wait of the
training loops for a batch (outside the store's own outages) and how soon batches
came again after the store was back.

The daemon restarted on another manifest is left by each rank that asks it again
(its probe, or a reopened stream, finds the other identity), with one line; a rank
that never asked it again before the run ended has nothing to say about it, and
received nothing from it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import xxhash

from bench.seaweedfs import seaweedfs
from clients import FeederLoader
from feeder.config import ServerConfig
from feeder.server import create_server
from tests.chaos.cluster import DATASET, Cluster, daemons_up, tell
from tests.chaos.evidence import Evidence, not_landed, recorded
from tests.chaos.schedule import Fault, Kind, schedule
from tests.common.env import child_env
from tests.common.mixes import build_extra_shards
from tests.common.s3 import pointed_at, upload_tree
from tests.common.shards import build_sample_shards

__all__ = ["Outcome", "RunConfig", "check", "fault_problems", "run"]

_ROOT = Path(__file__).resolve().parents[2]
_STORE_FAULTS = {Kind.STORE_STOPPED, Kind.STORE_KILLED, Kind.CREDENTIALS_ROTATED, Kind.OBJECT_DAMAGED}
_RECOVERY_S = 5.0  # after a store fault, the loop's waits still count as the store's
EXTRA = "extra"  # the mix's second dataset, served from each daemon's local disk


@dataclass(frozen=True)
class RunConfig:
    """A run: the schedule's seed and size, the plan, and where it works."""

    seed: int
    workdir: Path
    faults: int = 6
    quick: bool = False
    world_size: int = 2
    epochs: int = 3
    batch_size: int = 2
    image_size: int = 160  # 150 KB batches: a paused consumer's calls fill their windows, and idle
    classes: int = 8
    per_class: int = 48
    step_s: float = 0.02  # each batch's training step

    @property
    def mixed(self) -> bool:
        """Whether this run streams a mix (the even seeds)."""
        return self.seed % 2 == 0

    def loader_dataset(self) -> dict[str, Any]:
        """The loader's ``dataset`` (and ``epoch_samples``) for this run."""
        if not self.mixed:
            return {"dataset": DATASET}
        return {"dataset": {DATASET: 0.75, EXTRA: 0.25}, "epoch_samples": self.classes * self.per_class}


@dataclass
class Outcome:
    """What a run found: the faults made (with their evidence), each rank's figures,
    and every problem the checker saw (empty: the run passed)."""

    seed: int
    mixed: bool = False  # streamed a mix of the store's dataset and a local one
    extra_samples: int = 0  # samples of the mix's local dataset the ranks received (0 without a mix)
    epochs: int = 0
    faults: list[dict[str, Any]] = field(default_factory=list)
    ranks: list[dict[str, Any]] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"ok": self.ok}


# rank -> (epoch, key) -> (label, pixels, times in the epoch: a mix's small dataset repeats)
Reference = dict[int, dict[tuple[int, str], tuple[int, str, int]]]


def _hashes(images) -> list[str]:
    return [xxhash.xxh64(image.contiguous().numpy().tobytes()).hexdigest() for image in images]


def reference(config: RunConfig, datasets: dict[str, Path], epochs: int) -> Reference:
    """Each rank's plan of ``epochs`` epochs read without faults from one in-process
    daemon on the local copies (in batches of 64: which samples a rank's part holds and
    their pixels do not depend on the batch size)."""
    server, port = create_server(ServerConfig.of(datasets=datasets, port=0, device="cpu", threads=1, grace_s=0.5))
    found: Reference = {}
    try:
        for rank in range(config.world_size):
            found[rank] = {}
            with FeederLoader(address=f"127.0.0.1:{port}", **config.loader_dataset(), rank=rank,
                              world_size=config.world_size, batch_size=64, image_size=config.image_size,
                              seed=config.seed, normalize=False, return_keys=True, return_padding=True) as loader:
                for epoch in range(epochs):
                    loader.set_epoch(epoch)
                    for images, labels, keys, padding in loader:
                        for key, label, pixels, pad in zip(keys, labels, _hashes(images), padding):
                            if not pad:
                                times = found[rank].get((epoch, key), (0, "", 0))[2]
                                found[rank][epoch, key] = (int(label), pixels, times + 1)
    finally:
        server.stop(0).wait(10)
    return found


def check(expected: Reference, received: dict[int, list[dict[str, Any]]], epochs: int) -> list[str]:
    """Every problem of what the ranks received against the reference (one line each),
    over the first ``epochs`` epochs (each rank must have read them all)."""
    problems = []
    for rank, records in received.items():
        errors = [r["error"] for r in records if "error" in r]
        if errors:
            problems.append(f"rank {rank} ended: {errors[0]}")
        batches = [r for r in records if "error" not in r]
        for epoch in range(epochs):
            want = Counter({key: times for (e, key), (_, _, times) in expected[rank].items() if e == epoch})
            got: Counter[str] = Counter()
            for record in (b for b in batches if b["epoch"] == epoch):
                for key, label, pixels, pad in zip(record["keys"], record["labels"], record["hashes"],
                                                   record["padding"]):
                    if pad:
                        continue
                    got[key] += 1
                    if expected[rank].get((epoch, key), (label, pixels, 0))[:2] != (label, pixels):
                        problems.append(f"rank {rank} epoch {epoch}: {key} with another label or other pixels")
            lost, twice = sorted(want - got), sorted(k for k, n in got.items() if 0 < want[k] < n)
            extra = sorted(set(got) - set(want))
            if lost or twice or extra:
                problems.append(f"rank {rank} epoch {epoch}: {len(lost)} lost, {len(twice)} twice, {len(extra)} "
                                f"not its own (e.g. {(lost + twice + extra)[:3]})")
    return problems


def _rank_config(config: RunConfig, cluster: Cluster, rank: int) -> Path:
    path = config.workdir / f"rank-{rank}.json"
    path.write_text(json.dumps({
        "addresses": cluster.addresses, "rank": rank, "world_size": config.world_size,
        "batch_size": config.batch_size, "image_size": config.image_size, "seed": config.seed,
        "epochs": config.epochs, "step_s": config.step_s, "control": str(cluster.control),
        "out": str(config.workdir / f"rank-{rank}.jsonl"), "log": str(config.workdir / f"rank-{rank}.log"),
        # Longer than the longest store outage of a schedule: the job waits it out. The
        # gRPC payload: a paused consumer leaves its calls' windows full, so the daemons
        # cancel its streams for idleness (over shared memory nothing would be unread).
        "loader": {"reconnect_timeout_s": 600.0, "stall_timeout_s": 120.0, "transport": "grpc",
                   "prefetch_batches": 2, **config.loader_dataset()},
    }))
    return path


def _start_ranks(config: RunConfig, cluster: Cluster) -> list[subprocess.Popen[bytes]]:
    env = child_env(OMP_NUM_THREADS="1")
    ranks = []
    for rank in range(config.world_size):
        command = [sys.executable, "-m", "tests.chaos.rank", str(_rank_config(config, cluster, rank))]
        with open(config.workdir / f"rank-{rank}.err", "wb") as err:
            ranks.append(subprocess.Popen(command, cwd=_ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err))
    return ranks


def _records(config: RunConfig) -> dict[int, list[dict[str, Any]]]:
    found = {}
    for rank in range(config.world_size):
        path = config.workdir / f"rank-{rank}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        found[rank] = [json.loads(line) for line in lines if line.strip()]
    return found


def _wait_first_batches(config: RunConfig, ranks: list[subprocess.Popen[bytes]], timeout_s: float = 180) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if all(len(r) for r in _records(config).values()):
            return
        if any(p.poll() is not None for p in ranks):
            raise RuntimeError(f"a rank ended before its first batch: {_records(config)}")
        time.sleep(0.2)
    raise RuntimeError("the ranks had no first batch in time")


def _figures(records: list[dict[str, Any]], faults: list[dict[str, Any]]) -> dict[str, Any]:
    """A rank's batches, its longest wait for one, the longest of the waits that
    overlap none of the store's own faults (nor the ``_RECOVERY_S`` after each), and
    the longest time from the store being back to the rank's next batch (where that
    came before the next fault began)."""
    batches = [r for r in records if "error" not in r]
    store = [(f["begun"], f["ended"] + _RECOVERY_S) for f in faults if f["store"]]
    outside, recovery = [], []
    for batch in batches:
        start, end = batch["t"] - batch["wait_s"], batch["t"]
        if not any(start <= until and end >= begun for begun, until in store):  # the wait overlaps none of them
            outside.append(batch["wait_s"])
    for number, fault in enumerate(faults):
        if not fault["store"]:
            continue
        after = [b["t"] for b in batches if b["t"] >= fault["ended"]]
        following = faults[number + 1]["begun"] if number + 1 < len(faults) else float("inf")
        if after and after[0] <= following:  # a next fault begun first says nothing of this one's end
            recovery.append(round(after[0] - fault["ended"], 2))
    return {"batches": len(batches), "longest_wait_s": max((b["wait_s"] for b in batches), default=0.0),
            "longest_wait_outside_store_faults_s": max(outside, default=0.0),
            "first_batch_after_store_back_s": max(recovery, default=0.0),
            "reconnects": batches[-1]["reconnects"] if batches else 0,
            "error": next((r["error"] for r in records if "error" in r), None)}


def _fault_before(faults: list[dict[str, Any]], t: float) -> dict[str, Any] | None:
    """The last fault begun at or before ``t``."""
    begun = [f for f in faults if f["begun"] <= t]
    return begun[-1] if begun else None


def _longest_waits(faults: list[dict[str, Any]], received: dict[int, list[dict[str, Any]]]) -> None:
    """Each fault's longest wait of a training loop for a batch, over the ranks: of the
    waits begun while it was the last fault begun."""
    for fault in faults:
        fault["longest_wait_s"] = max((b["wait_s"] for records in received.values() for b in records
                                       if "error" not in b and _fault_before(faults, b["t"] - b["wait_s"]) is fault),
                                      default=0.0)


def _left_lines(config: RunConfig, rank: int, address: str) -> list[str]:
    """The error lines of a rank's log that leave ``address`` for serving another manifest."""
    log = config.workdir / f"rank-{rank}.log"
    text = log.read_text() if log.exists() else ""
    return [line for line in text.splitlines() if address in line and "manifest" in line and "ERROR" in line]


def run(config: RunConfig) -> Outcome:
    """Run one schedule and check it (see the module's docstring)."""
    started = time.monotonic()
    outcome = Outcome(config.seed, config.mixed)
    faults = schedule(config.seed, config.faults, config.quick)
    config.workdir.mkdir(parents=True, exist_ok=True)
    shards = build_sample_shards(config.workdir / "data", classes=config.classes, train_per_class=config.per_class,
                                 val_per_class=1)
    other = build_sample_shards(config.workdir / "other", classes=config.classes,
                                train_per_class=config.per_class - 3, val_per_class=1, seed=7)
    local = {EXTRA: build_extra_shards(config.workdir / "extra", train_per_class=16)} if config.mixed else {}
    control = config.workdir / "control"
    shutil.rmtree(control, ignore_errors=True)  # a run in this directory before left its own
    control.mkdir()
    for log in config.workdir.glob("daemon-*.log"):
        log.unlink()
    with seaweedfs(config.workdir / "store") as store, pointed_at(store):
        bucket = f"chaos-{config.seed}"
        store.filesystem().create_dir(bucket)
        url = upload_tree(store, shards, f"s3://{bucket}/{DATASET}")
        other_url = upload_tree(store, other, f"s3://{bucket}/other")
        options = ("--threads", "1", "--idle-timeout-s", "2", "--contended-idle-timeout-s", "2",
                   "--store-retry-window-s", "600", "--store-heal-s", "15")
        cluster = Cluster(store, url, other_url, control, options, config.seed, local)
        with daemons_up(cluster):
            ranks = _start_ranks(config, cluster)
            try:
                _wait_first_batches(config, ranks)
                outcome.faults = _make_faults(cluster, faults)
                reached = max((r["epoch"] for rs in _records(config).values() for r in rs if "epoch" in r), default=0)
                tell(control, "last_epoch", str(max(config.epochs - 1, reached + 1)))
                for process in ranks:
                    process.wait(timeout=900)
            finally:
                for process in ranks:
                    if process.poll() is None:
                        process.kill()
                        process.wait()
    received = _records(config)
    epochs = 1 + max((r["epoch"] for rs in received.values() for r in rs if "epoch" in r), default=0)
    outcome.epochs = max(epochs, config.epochs)
    outcome.problems = check(reference(config, {DATASET: shards, **local}, outcome.epochs), received, outcome.epochs)
    outcome.problems += fault_problems(outcome.faults, received)
    outcome.extra_samples = sum(key.startswith(f"{EXTRA}/") for records in received.values() for r in records
                                for key in r.get("keys", ()))
    for number, fault in enumerate(faults):
        if fault.kind is Kind.DAEMON_OTHER_MANIFEST:  # left with one line by each rank that asked it again
            for rank in range(config.world_size):
                lines = _left_lines(config, rank, cluster.addresses[fault.target])
                if len(lines) > 1:
                    outcome.problems.append(f"fault {number}: rank {rank} wrote {len(lines)} lines naming the daemon "
                                            "on another manifest, at most one expected")
    _longest_waits(outcome.faults, received)
    outcome.ranks = [_figures(received[r], outcome.faults) for r in range(config.world_size)]
    outcome.seconds = round(time.monotonic() - started, 1)
    return outcome


class _FaultMaker(Protocol):
    def make(self, fault: Fault) -> Evidence: ...


def _make_faults(cluster: _FaultMaker, faults: list[Fault]) -> list[dict[str, Any]]:
    """Make the faults in order, each at its time (or once the one before is over),
    each with what was measured while it was made and what of it did not happen."""
    t0, made = time.monotonic(), []
    wall0 = time.time()
    for fault in faults:
        delay = fault.at_s - (time.monotonic() - t0)
        if delay > 0:
            time.sleep(delay)
        begun = time.time()
        evidence: Evidence | None = None
        try:
            evidence = cluster.make(fault)
            missed = not_landed(fault.kind, evidence)
        except Exception as e:  # noqa: BLE001 - recorded: a fault that could not be made fails the run
            missed = [f"not made: {type(e).__name__}: {e}"]
        ended = time.time()
        made.append({"kind": fault.kind.name, "what": fault.kind.value, "target": fault.target,
                     "store": fault.kind in _STORE_FAULTS, "planned_at_s": fault.at_s, "at_s": round(begun - wall0, 1),
                     "lasted_s": round(ended - begun, 1), "begun": begun, "ended": ended,
                     "evidence": recorded(evidence), "not_landed": missed})
    return made


def _named(fault: dict[str, Any]) -> str:
    target = f" {fault['target']}" if fault["kind"].startswith("DAEMON") else ""
    return fault["kind"].lower().replace("_", " ").replace("daemon", f"daemon{target}", 1)


def fault_problems(faults: list[dict[str, Any]], received: dict[int, list[dict[str, Any]]]) -> list[str]:
    """A line for each part of a fault that did not happen (its predicate's), and for
    each fault that met no rank reading: a rank's batch before it began and after
    it ended, or the fault came when the work was not going on."""
    problems = [f"fault {n} ({_named(f)}): {missed}" for n, f in enumerate(faults) for missed in f["not_landed"]]
    for n, fault in enumerate(faults):
        for rank, records in received.items():
            times = [r["t"] for r in records if "error" not in r]
            if not any(t < fault["begun"] for t in times) or not any(t > fault["ended"] for t in times):
                problems.append(f"fault {n} ({_named(fault)}): rank {rank} had no batch before it began "
                                "and after it ended")
    return problems


def main_one(seed: int, workdir: Path, quick: bool) -> Outcome:
    """:func:`run` with the defaults, for one seed (tests and the command)."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    return run(RunConfig.of(seed=seed, workdir=workdir, quick=quick))
