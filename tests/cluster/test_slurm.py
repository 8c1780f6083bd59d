"""``deploy/slurm/train.sbatch`` on a real one-host Slurm (:mod:`tests.common.slurm`):
the recipe as a user submits it, on CPU (one node, two gloo ranks, resnet18 on the
sample shards at 32 px), through ``feeder run`` and torchrun's c10d rendezvous.

- A trivial job proves the cluster: ``sbatch --wait --wrap hostname`` COMPLETED.
- The recipe trains two epochs to COMPLETED; its visit log shows every training
  sample trained on exactly once per epoch; nothing of the job (the daemon, torchrun,
  a rank) is left running and none of the daemon's shared-memory segments is left.
- Cancelled after its first checkpoint it ends CANCELLED; submitted again it resumes
  at the checkpoint's epoch and sample cursor (the last checkpoint, which may be at an
  epoch's last step) and COMPLETES, and over both runs each
  sample was trained on once per epoch: the checkpoint carries the visit counts up to
  its cursor, the resumed run trains from that cursor on, so what the cancelled run
  trained after its checkpoint is neither counted nor kept.
- USR1 to the batch script (what ``--signal=B:USR1@600`` sends before the time limit)
  before its first checkpoint is not acted on; after it, the job is requeued, runs
  again under its id, resumes and COMPLETES, each sample once per epoch.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.seaweedfs import free_ports
from shards.layout import index_path
from tests.common.env import ROOT, child_env
from tests.common.shards import build_sample_shards
from tests.common.slurm import SlurmCluster, slurm_or_skip
from tests.common.waiting import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.slow]

RECIPE = ROOT / "deploy" / "slurm" / "train.sbatch"
CLASSES, TRAIN_PER_CLASS = 4, 32
EPOCHS, RANKS, BATCH = 2, 2, 8
STEPS_PER_EPOCH = CLASSES * TRAIN_PER_CLASS // (RANKS * BATCH)  # 8
CHECKPOINT_EVERY_STEPS = 3  # epoch 0 has checkpoints at cursors 24 and 48 of 64
SCHEDULE = f"""
warmup_epochs = 0.5
weight_decay = 5e-5
label_smoothing = 0.1
lr_reference_batch = 0

[[phases]]
epochs = {EPOCHS}
image_size = 32
batch_size = {BATCH}
lr_start = 0.05
lr_end = 0.01
momentum = 0.9
min_scale = 0.35
"""
JOB_TIMEOUT_S = 240.0  # one run takes 30 to 90 s on a loaded 2-core machine, most of it starting up
DAEMON_LINE = re.compile(r"feeder run: daemon serving on \S+ \(pid (\d+)\)")
RESUMED_LINE = re.compile(r"resumed at step (\d+): epoch (\d+), cursor (\d+)")


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    with slurm_or_skip(tmp_path_factory.mktemp("slurm")) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("shards"), classes=CLASSES,
                               train_per_class=TRAIN_PER_CLASS, val_per_class=2)


@dataclass(frozen=True)
class Run:
    """One training run's files and the environment that points the recipe at them."""

    folder: Path
    env: dict[str, str]

    @property
    def checkpoints(self) -> Path:
        return self.folder / "checkpoints"

    @property
    def visits(self) -> Path:
        return self.folder / "visits"

    def output(self, job: int) -> str:
        path = self.folder / f"slurm-{job}.out"
        return path.read_text(errors="replace") if path.is_file() else ""


@pytest.fixture
def socket_dir() -> Iterator[Path]:
    """A short directory for the daemon's socket (a unix socket path has 107 bytes at
    most; pytest's temporary directories can be longer)."""
    folder = Path(tempfile.mkdtemp(prefix="feeder-slurm-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def run(tmp_path: Path, shards: Path, socket_dir: Path) -> Run:
    schedule = tmp_path / "schedule.toml"
    schedule.write_text(SCHEDULE)
    env = {
        "SHARDS": str(shards), "DATASET": "sample", "CHECKPOINT_DIR": str(tmp_path / "checkpoints"),
        "OUT_DIR": str(tmp_path / "out"), "GPUS_PER_NODE": str(RANKS), "ARCH": "resnet18",
        "SCHEDULE": str(schedule), "CHECKPOINT_EVERY_STEPS": str(CHECKPOINT_EVERY_STEPS),
        "RDZV_PORT": str(free_ports(1)[0]), "SOCKET_PATH": str(socket_dir / "feeder.sock"),
        # The default /dev/shm: the trainer opens its rings there (segments of other
        # tests' daemons are told apart by this daemon's pid in their names).
        "SHM_DIR": "/dev/shm",
        "FEEDER_OPTS": "--device cpu --threads 1 --grace-s 1",
        "TRAIN_OPTS": f"--device cpu --val-every-epochs 0 --log-every-steps 0 --visit-log {tmp_path / 'visits'}",
        "OMP_NUM_THREADS": "1",
        # feeder and torchrun of this interpreter's environment, this checkout first on the path
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        "PYTHONPATH": child_env()["PYTHONPATH"],
    }
    return Run(tmp_path, env)


def _submit(slurm: SlurmCluster, run: Run, *extra: str) -> int:
    """The recipe on this cluster's one node, on CPU."""
    # --time above the recipe's --signal lead (10 minutes), or USR1 comes at once
    return slurm.submit("--nodes=1", "--gpus-per-node=0", "--time=30", f"--chdir={run.folder}",
                        f"--output={run.folder / 'slurm-%j.out'}", *extra, str(RECIPE), env=run.env,
                        timeout_s=JOB_TIMEOUT_S)


def _train_keys(shards: Path) -> list[str]:
    return pq.read_table(index_path(shards, "train"), columns=["key"]).column("key").to_pylist()


def _visits(folder: Path) -> Counter[str]:
    counts: Counter[str] = Counter()
    for path in sorted(folder.glob("rank-*.json")):
        counts.update(json.loads(path.read_text()))
    return counts


def _daemon_pids(output: str) -> list[int]:
    return [int(pid) for pid in DAEMON_LINE.findall(output)]


def _assert_nothing_left(slurm: SlurmCluster, output: str) -> None:
    """No process of the cluster's jobs runs, and no segment of the job's daemons is
    left in /dev/shm."""
    assert wait_for(lambda: not slurm.job_processes(), timeout_s=10), slurm.job_processes()
    pids = _daemon_pids(output)
    assert pids, output[-3000:]
    for pid in pids:
        assert not Path(f"/proc/{pid}").exists() or _zombie(pid), f"daemon {pid} still runs"
        assert not list(Path("/dev/shm").glob(f"feeder-{pid}-*")), f"segments of daemon {pid} left"


def _wait_for_checkpoint(slurm: SlurmCluster, job: int, latest: Path) -> None:
    """Until ``latest`` exists (looked at every 20 ms: a step takes about 0.5 s here);
    fails if the job ends first."""
    deadline = time.monotonic() + JOB_TIMEOUT_S
    next_look = 0.0
    while not latest.is_file():
        now = time.monotonic()
        assert now < deadline, f"no checkpoint after {JOB_TIMEOUT_S:.0f} s"
        if now >= next_look:
            state = slurm.state(job)
            assert state in {"PENDING", "CONFIGURING", "RUNNING"}, f"job {job} {state} before its first checkpoint"
            next_look = now + 1.0
        time.sleep(0.02)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return True


def test_a_trivial_job_completes(slurm: SlurmCluster, tmp_path: Path) -> None:
    job = slurm.submit("--wait", f"--output={tmp_path / 'out.txt'}", "--wrap", "srun hostname")
    assert slurm.final_state(job) == "COMPLETED"
    assert (tmp_path / "out.txt").read_text().split() == [slurm.node]


def test_recipe_trains_every_sample_once_per_epoch(slurm: SlurmCluster, shards: Path, run: Run) -> None:
    job = _submit(slurm, run, "--wait")
    output = run.output(job)
    assert slurm.final_state(job) == "COMPLETED", output[-5000:]
    assert f"training resnet18 on feeder data, {RANKS} rank(s) on cpu, {EPOCHS} epochs" in output
    assert "resumed at step" not in output  # --resume with no checkpoint yet starts afresh
    assert _visits(run.visits) == Counter({key: EPOCHS for key in _train_keys(shards)})
    summary = json.loads((run.folder / "out" / "summary.json").read_text())
    assert summary["epochs"] == EPOCHS and summary["steps"] == EPOCHS * STEPS_PER_EPOCH
    _assert_nothing_left(slurm, output)


@pytest.mark.timeout(480)
def test_cancelled_mid_epoch_then_resubmitted_trains_every_sample_once_per_epoch(
    slurm: SlurmCluster, shards: Path, run: Run
) -> None:
    latest = run.checkpoints / "LATEST"
    first = _submit(slurm, run)
    _wait_for_checkpoint(slurm, first, latest)
    slurm.run("scancel", str(first))
    assert slurm.final_state(first) == "CANCELLED", run.output(first)[-5000:]
    assert latest.read_text().startswith("step-")
    checkpointed = int(latest.read_text().removeprefix("step-"))
    # scancel's SIGTERM: the ranks checkpoint where they are, unless it came at a periodic one.
    stopped = f"SIGTERM: stopped after the checkpoint at step {checkpointed}" in run.output(first)
    assert stopped or checkpointed % CHECKPOINT_EVERY_STEPS == 0, run.output(first)[-5000:]
    assert not run.visits.exists()  # the cancelled run never reached its end
    _assert_nothing_left(slurm, run.output(first))

    second = _submit(slurm, run, "--wait")
    output = run.output(second)
    assert slurm.final_state(second) == "COMPLETED", output[-5000:]
    resumed = RESUMED_LINE.search(output)
    assert resumed is not None, output[-5000:]
    step, epoch, cursor = map(int, resumed.groups())
    # Where the cancelled run stopped: after its first checkpoint (step 3), before its end.
    # SIGTERM is acted on a few steps after it lands, so that may be at the last step of an
    # epoch, whose checkpoint keeps the epoch with its cursor at the end (64 of 64).
    assert step == checkpointed and CHECKPOINT_EVERY_STEPS <= step < EPOCHS * STEPS_PER_EPOCH, resumed[0]
    in_epoch = (step - 1) // STEPS_PER_EPOCH
    assert (epoch, cursor) == (in_epoch, (step - in_epoch * STEPS_PER_EPOCH) * BATCH), resumed[0]
    assert _visits(run.visits) == Counter({key: EPOCHS for key in _train_keys(shards)})
    _assert_nothing_left(slurm, output)



@pytest.mark.timeout(480)
def test_usr1_before_the_time_limit_requeues_the_job_and_it_resumes(
    slurm: SlurmCluster, shards: Path, run: Run
) -> None:
    # What --signal=B:USR1@600 does 10 minutes before the time limit, sent now.
    latest = run.checkpoints / "LATEST"
    job = _submit(slurm, run)
    # Once the step runs (a signal while srun is still launching it aborts it: scancel
    # --batch signals the batch shell's children too). No checkpoint yet: no requeue.
    assert wait_for(lambda: DAEMON_LINE.search(run.output(job)) is not None, timeout_s=JOB_TIMEOUT_S), \
        run.output(job)[-5000:]
    slurm.run("scancel", "--batch", "--signal=USR1", str(job))
    assert wait_for(lambda: "not requeueing" in run.output(job), timeout_s=30), run.output(job)[-5000:]
    _wait_for_checkpoint(slurm, job, latest)
    slurm.run("scancel", "--batch", "--signal=USR1", str(job))

    assert slurm.final_state(job, timeout_s=JOB_TIMEOUT_S) == "COMPLETED", run.output(job)[-5000:]
    output = run.output(job)
    assert "requeueing job" in output and "(restart 1)" in output, output[-5000:]
    assert len(slurm.completion_states(job)) == 2  # the requeued run's line, then the last one's
    resumed = RESUMED_LINE.search(output)
    assert resumed is not None and int(resumed[1]) >= CHECKPOINT_EVERY_STEPS, output[-5000:]
    assert _visits(run.visits) == Counter({key: EPOCHS for key in _train_keys(shards)})
    _assert_nothing_left(slurm, output)
