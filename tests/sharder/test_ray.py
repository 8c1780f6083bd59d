"""``feeder shard SRC OUT --ray ADDRESS`` on a real Ray cluster of two nodes on this
host (``ray.cluster_utils.Cluster``: a head and a worker node, one CPU each, their
own raylets and object stores): the same bytes as a one-machine run with the same
seed, whatever the tasks per node, with a node dying under the run, with the
driver killed and the command run again, and from an object store."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.seaweedfs import SeaweedFS
from sharder import ShardConfig, shard
from tests.common.s3 import fresh_bucket, pointed_at, upload_tree
from tests.common.shards import build_sample_tree
from tests.sharder.downloads import same_output
from tests.sharder.runs import REPO, tree_bytes

SHARD_BYTES = 40_000
SEED = 7

pytestmark = pytest.mark.cluster

_KILL_AFTER_SECOND_SHARD = """
import os, signal, sys
from sharder import ShardConfig, shard

def die(split, number):
    if number == 1:
        os.kill(os.getpid(), signal.SIGKILL)

shard(ShardConfig(sys.argv[1], sys.argv[2], seed=7, shard_size_bytes=int(sys.argv[3]), ray=sys.argv[4],
                  on_shard_done=die))
"""


@pytest.fixture(scope="module")
def cluster() -> Iterator[object]:
    """Two Ray nodes of one CPU each."""
    cluster_utils = pytest.importorskip("ray.cluster_utils")
    cluster = cluster_utils.Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
    cluster.add_node(num_cpus=1)
    cluster.wait_for_nodes()
    try:
        yield cluster
    finally:
        cluster.shutdown()


@pytest.fixture(scope="module")
def src(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_sample_tree(tmp_path_factory.mktemp("ray-src"), classes=4, train_per_class=24, val_per_class=4)


@pytest.fixture(scope="module")
def local(src: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The one-machine run every Ray run must equal."""
    out = tmp_path_factory.mktemp("ray-local") / "out"
    shard(ShardConfig(src, out, seed=SEED, shard_size_bytes=SHARD_BYTES))
    return out


@pytest.mark.parametrize("tasks_per_node", [1, 2, 3])
def test_a_ray_run_is_the_bytes_of_a_local_run_whatever_the_tasks_per_node(
        cluster, src: Path, local: Path, tmp_path: Path, tasks_per_node: int) -> None:
    report = shard(ShardConfig(src, tmp_path / "out", seed=SEED, shard_size_bytes=SHARD_BYTES,
                               ray=cluster.address, ray_tasks_per_node=tasks_per_node))
    assert tree_bytes(tmp_path / "out") == tree_bytes(local)
    assert report.total("accepted") == 112 and report.total("shards") > 4


def test_a_node_dying_under_the_run_costs_only_its_tasks(cluster, src: Path, local: Path, tmp_path: Path) -> None:
    worker = cluster.list_all_nodes()[-1]
    assert worker is not cluster.head_node
    removed = []

    def kill_the_worker_node(split: str, number: int) -> None:
        if not removed:  # its tasks are in flight now: the window holds several per node
            cluster.remove_node(worker, allow_graceful=False)
            removed.append(number)

    try:
        shard(ShardConfig(src, tmp_path / "out", seed=SEED, shard_size_bytes=SHARD_BYTES, ray=cluster.address,
                          ray_tasks_per_node=3, on_shard_done=kill_the_worker_node))
    finally:
        if removed:
            cluster.add_node(num_cpus=1)
            cluster.wait_for_nodes()
    assert removed == [0]
    assert tree_bytes(tmp_path / "out") == tree_bytes(local)


def test_a_killed_driver_resumes_when_run_again(cluster, src: Path, local: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = os.environ | {"PYTHONDONTWRITEBYTECODE": "1"}
    killed = subprocess.run([sys.executable, "-c", _KILL_AFTER_SECOND_SHARD, str(src), str(out), str(SHARD_BYTES),
                             cluster.address], cwd=REPO, env=env, capture_output=True, timeout=300)
    assert killed.returncode == -9, killed.stderr.decode()[-2000:]
    assert (out / ".work" / "train" / "shard-000001.json").is_file() and not (out / "manifest.json").exists()
    rerun = subprocess.run([sys.executable, "-m", "feeder", "shard", str(src), str(out), "--seed", str(SEED),
                            "--shard-size-bytes", str(SHARD_BYTES), "--ray", cluster.address, "--no-progress"],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert tree_bytes(out) == tree_bytes(local)


def test_an_object_store_source_shards_on_ray_to_the_bytes_of_its_local_copy(
        cluster, s3_server: SeaweedFS, src: Path, local: Path, tmp_path: Path) -> None:
    url = upload_tree(s3_server, src, f"s3://{fresh_bucket(s3_server)}/imagenet")
    with pointed_at(s3_server):  # the driver's AWS_* settings go with its tasks
        shard(ShardConfig(url, tmp_path / "out", seed=SEED, shard_size_bytes=SHARD_BYTES,
                          s3_endpoint=s3_server.endpoint_url, ray=cluster.address))
    same_output(local, tmp_path / "out")
