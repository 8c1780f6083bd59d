"""One job on two nodes, end to end, on this host: two ``feeder run`` launchers (each
its node's daemon, on its own port, socket, shared-memory directory and shard cache,
both reading the shards from one SeaweedFS bucket), each wrapped around ``torchrun
--nnodes 2`` with c10d rendezvous, 2 ranks per node; each rank is fed by its node's
daemon with the other node's in its pool. Every sample is trained on once per epoch
when all goes well, when a node's daemon is SIGKILLed mid-epoch, and when a whole node
is lost and the job resumes from its checkpoint on the node that is left."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from bench.proctree import kill_env, pids_with_env
from bench.seaweedfs import SeaweedFS, free_ports
from shards.layout import index_path
from tests.common.env import ROOT, child_env
from tests.common.processes import kill_tree
from tests.common.s3 import fresh_bucket, upload_tree
from tests.common.shards import build_sample_shards
from tests.common.waiting import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.cluster]

EPOCHS = 2
# One phase of 2 epochs: 256 samples over 4 ranks in batches of 8, 8 steps an epoch.
SCHEDULE = """
warmup_epochs = 0.0
weight_decay = 5e-5
label_smoothing = 0.1
lr_reference_batch = 0

[[phases]]
epochs = 2
image_size = 32
batch_size = 8
lr_start = 0.05
lr_end = 0.01
momentum = 0.9
min_scale = 0.35
"""


@pytest.fixture(scope="module")
def local_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_shards(tmp_path_factory.mktemp("two-node-shards"), classes=4, train_per_class=64,
                               val_per_class=4)


@pytest.fixture(scope="module")
def bucket(s3_server: SeaweedFS, local_shards: Path) -> str:
    return upload_tree(s3_server, local_shards, f"s3://{fresh_bucket(s3_server, 'nodes')}/sample")


class Job:
    """The job's shared directories (its out dir stands for shared storage) and its
    nodes' launchers, each process marked so none can be left behind unseen."""

    def __init__(self, tmp: Path, bucket: str, server: SeaweedFS) -> None:
        self.tmp, self.bucket = tmp, bucket
        self.out, self.visit_dir = tmp / "out", tmp / "visits"
        self.schedule = tmp / "schedule.toml"
        self.schedule.write_text(SCHEDULE)
        self.mark = uuid.uuid4().hex
        self.env = child_env(OMP_NUM_THREADS="1", FEEDER_TEST_RUN=self.mark, **server.environment())
        for name in ("FEEDER_ADDRESS", "FEEDER_TOKEN", "FEEDER_SHM_DIR"):
            self.env.pop(name, None)
        self.ports = free_ports(2)
        self.nodes: dict[int, subprocess.Popen[bytes]] = {}

    def node_dir(self, node: int) -> Path:
        path = self.tmp / f"node-{node}"
        for sub in ("shm", "cache"):
            (path / sub).mkdir(parents=True, exist_ok=True)
        return path

    def log(self, node: int, run: int = 0) -> Path:
        return self.tmp / f"node-{node}-run-{run}.log"

    def start(self, node: int, nnodes: int = 2, run: int = 0, *extra: str) -> None:
        """Node ``node``'s launcher, around its torchrun (``nnodes`` in the job)."""
        home = self.node_dir(node)
        pool = [f"--pool-with=127.0.0.1:{self.ports[other]}" for other in range(nnodes) if other != node]
        rendezvous = (["--standalone"] if nnodes == 1 else
                      ["--nnodes", str(nnodes), "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{self.rdzv}",
                       "--rdzv-id", f"job-{self.mark[:8]}-{run}"])
        command = [
            sys.executable, "-m", "feeder", "run", "--dataset", f"sample={self.bucket}", "--device", "cpu",
            "--threads", "1", "--port", str(self.ports[node]), "--socket-path", str(home / "feeder.sock"),
            "--shm-dir", str(home / "shm"), "--cache-dir", str(home / "cache"), "--grace-s", "1", *pool, "--",
            sys.executable, "-m", "torch.distributed.run", *rendezvous, "--nproc-per-node", "2",
            "-m", "trainer.train", "--dataset", "sample", "--device", "cpu", "--arch", "resnet18",
            "--schedule", str(self.schedule), "--out-dir", str(self.out), "--visit-log", str(self.visit_dir),
            "--val-every-epochs", "0", "--log-every-steps", "0", "--checkpoint-every-steps", "2", *extra,
        ]
        with self.log(node, run).open("wb") as log:
            self.nodes[node] = subprocess.Popen(command, cwd=ROOT, env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT)

    rdzv = 0

    def start_all(self) -> None:
        self.rdzv = free_ports(1)[0]
        for node in (0, 1):
            self.start(node)

    def wait(self, node: int, timeout_s: float = 300) -> int:
        try:
            return self.nodes[node].wait(timeout_s)
        except subprocess.TimeoutExpired:
            pytest.fail(f"node {node} still running after {timeout_s:.0f} s: {self.tail(node)}")

    def tail(self, node: int, run: int = 0) -> str:
        return self.log(node, run).read_text(errors="replace")[-4000:]

    def daemon_pids(self, node: int, run: int = 0) -> list[int]:
        lines = [line for line in self.log(node, run).read_text(errors="replace").splitlines()
                 if line.startswith("feeder run: daemon serving on")]
        return [int(line.split("(pid ")[1].split(")")[0]) for line in lines]

    def latest_step(self) -> int:
        latest = self.out / "checkpoints" / "LATEST"
        try:
            return int(latest.read_text().removeprefix("step-"))
        except (OSError, ValueError):
            return 0

    def visits(self) -> Counter[str]:
        found: Counter[str] = Counter()
        for path in sorted(self.visit_dir.glob("rank-*.json")):
            found.update(json.loads(path.read_text()))
        return found

    def epochs(self) -> list[dict[str, str]]:
        with (self.out / "metrics.csv").open() as rows:
            return list(csv.DictReader(rows))

    def nothing_left(self, nodes: tuple[int, ...] = (0, 1)) -> None:
        assert wait_for(lambda: not pids_with_env("FEEDER_TEST_RUN", self.mark), timeout_s=20), \
            pids_with_env("FEEDER_TEST_RUN", self.mark)
        for node in nodes:
            home = self.node_dir(node)
            assert not list((home / "shm").iterdir()) and not (home / "feeder.sock").exists()

    def close(self) -> None:
        for proc in self.nodes.values():
            if proc.poll() is None:
                kill_tree(proc.pid)
                proc.wait(30)
        kill_env("FEEDER_TEST_RUN", self.mark)


@pytest.fixture()
def job(tmp_path: Path, bucket: str, s3_server: SeaweedFS) -> Iterator[Job]:
    found = Job(tmp_path, bucket, s3_server)
    yield found
    found.close()


def _keys(local_shards: Path) -> list[str]:
    return pq.read_table(index_path(local_shards, "train"), columns=["key"]).column("key").to_pylist()


def test_two_nodes_train_two_epochs_on_every_sample_once_per_epoch(job, local_shards):
    job.start_all()
    assert [job.wait(0), job.wait(1)] == [0, 0], job.tail(0) + job.tail(1)
    assert job.visits() == Counter({key: EPOCHS for key in _keys(local_shards)})
    assert [int(row["train_images"]) for row in job.epochs()] == [len(_keys(local_shards))] * EPOCHS
    for node in (0, 1):  # each daemon fed its node's ranks over shared memory and the other node's too
        opened = [line for line in job.log(node).read_text().splitlines() if ") opened: " in line]
        assert any("(unix:" in line and "over shm" in line for line in opened), opened
        assert any("(ipv4:127.0.0.1:" in line for line in opened), opened
    job.nothing_left()


def test_a_nodes_daemon_killed_mid_epoch_is_covered_by_the_other_and_comes_back(job, local_shards):
    job.start_all()
    assert wait_for(lambda: job.latest_step() >= 2, timeout_s=240), job.tail(1)  # mid epoch 0
    killed = job.daemon_pids(1)[0]
    os.kill(killed, signal.SIGKILL)
    assert [job.wait(0), job.wait(1)] == [0, 0], job.tail(0) + job.tail(1)
    log = job.log(1).read_text(errors="replace")
    assert "feeder run: the daemon is gone (SIGKILL); starting one again in 1 s (restart 1 of 5)" in log
    assert len(job.daemon_pids(1)) == 2  # started again while the ranks trained on
    # The ranks met the kill (their pool left the daemon), not only the launcher.
    here, there = str(job.node_dir(1) / "feeder.sock"), f"127.0.0.1:{job.ports[1]}"
    failed = [line for node in (0, 1) for line in job.log(node).read_text(errors="replace").splitlines()
              if "of the pool failed" in line and (there in line or (node == 1 and here in line))]
    assert failed, job.tail(0) + job.tail(1)
    assert job.visits() == Counter({key: EPOCHS for key in _keys(local_shards)})
    longest = max(float(row["longest_wait_s"]) for row in job.epochs())
    assert longest <= 2.0, f"the training loop waited {longest:.2f} s for a batch"
    job.nothing_left()


def test_a_node_lost_whole_resumes_on_the_node_left_with_every_sample_once(job, local_shards):
    job.start_all()
    assert wait_for(lambda: job.latest_step() >= 4, timeout_s=240), job.tail(1)  # mid epoch 0
    kill_tree(job.nodes[1].pid)  # the launcher, its daemon, torchrun and its ranks, at once
    job.nodes[1].wait(30)
    # The ranks of node 0 lose their peers; torchrun ends them, or they are stopped.
    deadline = time.monotonic() + 120
    while job.nodes[0].poll() is None and time.monotonic() < deadline:
        time.sleep(0.5)
    job.close()
    checkpoint = job.latest_step()
    assert checkpoint >= 4
    job.start(0, 1, 1, "--resume")
    assert job.wait(0) == 0, job.tail(0, 1)
    resumed = job.log(0, 1).read_text(errors="replace")
    assert f"resumed at step {checkpoint}" in resumed and "4 ranks then, 2 now" in resumed, resumed[-3000:]
    assert job.visits() == Counter({key: EPOCHS for key in _keys(local_shards)})
    job.nothing_left((0,))  # node 1's daemon was killed with it: its next start sweeps what it left
