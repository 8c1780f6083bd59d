"""``feeder run`` beside a daemon already serving on the node: shared only where it
serves the launcher's own data and pixels under each name, else refused in one line
naming both before the command starts; the options it does not have named; the
command given its shared-memory directory."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from feeder.config import ServerConfig
from feeder.server import FeederServer, create_server
from launcher.daemon_process import DaemonProcess
from tests.common.env import ROOT
from tests.common.launcher_runs import N_TRAIN, Run, consumer, nothing_left, serve_args
from tests.common.shards import build_sample_shards
from tests.common.waiting import wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def other_shards(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another dataset, to be served under the same name."""
    return build_sample_shards(tmp_path_factory.mktemp("other-shards"), classes=4, train_per_class=8,
                               val_per_class=2)


@pytest.fixture()
def serving(node: dict, tmp_path: Path) -> Iterator[Path]:
    """A daemon already serving ``sample`` on the node's socket, its rings in a
    directory of its own: that directory."""
    rings = tmp_path / "daemon-shm"
    rings.mkdir()
    daemon = DaemonProcess({"sample": node["shards"]}, ("--device", "cpu", "--threads", "1", "--grace-s", "1",
                                                        "--socket-path", str(node["socket"]), "--shm-dir", str(rings)),
                           cwd=ROOT, health_address=f"unix:{node['socket']}")
    daemon.start()
    try:
        yield rings
    finally:
        assert daemon.returncode is None  # never the launcher's to stop
        daemon.stop()


def _refused(run: Run, marker: Path) -> str:
    """The one line a refused run said; the command never ran."""
    assert run.wait() == 1
    errors = [line for line in run.err if line.startswith("feeder: error:")]
    assert len(errors) == 1, run.err
    assert not marker.exists() and not run.daemon_pids()
    return errors[0]


def test_a_daemon_serving_another_directory_under_the_name_is_not_shared(node, serving, other_shards, tmp_path):
    marker = tmp_path / "ran"
    args = [a if a != f"sample={node['shards']}" else f"sample={other_shards}" for a in serve_args(node)]
    line = _refused(Run([*args, "--", "touch", str(marker)], node["env"]), marker)
    assert f"datasets: sample={other_shards} is manifest " in line
    assert f"the daemon already serving on unix:{node['socket']} serves sample/" in line and "not shared" in line
    mine, theirs = line.split(" is manifest ", 1)[1], line.split(" as manifest ", 1)[1]
    assert mine.split(",")[0] != theirs.split(",")[0]  # both manifests named, and they differ


def test_a_daemon_serving_other_pixels_under_the_name_is_not_shared(node, serving, tmp_path):
    marker = tmp_path / "ran"
    line = _refused(Run([*serve_args(node, "--max-pixels", "1000000"), "--", "touch", str(marker)], node["env"]),
                    marker)
    assert "(max_pixels 1000000 against 89478485)" in line and "not shared" in line


def test_a_shared_daemon_names_the_options_it_lacks_and_gives_its_own_shm_dir(node, serving, tmp_path):
    run = Run([*serve_args(node, "--queue-batches", "3"), "--", *consumer(tmp_path)], node["env"])
    assert run.wait() == 0
    assert run.said(f"using the daemon already serving on unix:{node['socket']}")
    (warning,) = run.said("the shared daemon keeps its own options")
    assert warning.endswith(f"not applied: --queue-batches 3 (it has 4), --shm-dir {node['shm']} (it has {serving})")
    assert f"shm dir {serving}" in run.out
    assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"  # over shared memory, in the daemon's directory
    assert not run.daemon_pids()


def test_a_daemon_serving_the_same_data_and_options_is_shared_without_a_word(node, serving, tmp_path):
    run = Run([*serve_args(node, "--shm-dir", str(serving)), "--", *consumer(tmp_path)], node["env"])
    assert run.wait() == 0
    assert run.said("using the daemon already serving on") and not run.said("keeps its own options")
    assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"


def _in_process(node: dict, shards: Path) -> ServerConfig:
    """A daemon of the node's socket and shm dir, run in this process."""
    return ServerConfig.of(datasets={"sample": shards}, device="cpu", threads=1, port=0, grace_s=0.5,
                           socket_path=node["socket"], shm_dir=node["shm"])


def test_a_run_whose_daemon_lost_the_socket_to_another_shares_that_one_saying_so(node, tmp_path):
    # Before: its own daemon's "feeder: error: socket_path: a daemon is serving on ..."
    # line, then the shared daemon used (or, while the other one was not serving yet,
    # the run ended with that error).
    other = FeederServer(_in_process(node, node["shards"]))
    other.bind()  # the socket taken, nothing served yet: another launcher's daemon starting
    try:
        run = Run([*serve_args(node), "--", *consumer(tmp_path)], node["env"])
        assert wait_for(lambda: bool(run.said("another daemon took")), timeout_s=90), run.err
        other.start()
        assert run.wait() == 0
    finally:
        other.stop(0).wait(10)
    assert not [line for line in run.err if "error" in line], run.err
    assert run.said(f"another daemon took unix:{node['socket']} while this launcher's own was starting; waiting")
    assert run.said(f"using the daemon already serving on unix:{node['socket']}") and not run.daemon_pids()
    assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"


def test_a_shared_daemon_replaced_by_another_is_checked_again(node, other_shards, tmp_path):
    # Before: checked once, when first shared; a daemon of other data that took its
    # place was never looked at.
    marker = tmp_path / "replaced"
    wait = f'until [ -e "{marker}" ]; do sleep 0.1; done'
    first, _ = create_server(_in_process(node, node["shards"]))
    try:
        run = Run([*serve_args(node), "--", "sh", "-c", wait], node["env"])
        assert wait_for(lambda: bool(run.said("using the daemon already serving on")), timeout_s=90), run.err
        first.stop(0).wait(10)
        replaced, _ = create_server(_in_process(node, other_shards))
        try:
            assert wait_for(lambda: bool(run.said("another daemon now serves on")), timeout_s=30), run.err
        finally:
            marker.touch()
            assert run.wait() == 0
            replaced.stop(0).wait(10)
    finally:
        first.stop(0).wait(10)
    (line,) = run.said("another daemon now serves on")
    assert line.startswith(f"feeder run: another daemon now serves on unix:{node['socket']}, not what this launcher "
                           f"would: datasets: sample={node['shards']} is manifest ")
    assert line.endswith("its loaders will refuse it (FAILED_PRECONDITION); stop it, or run this job beside a daemon "
                         "of its own")
    assert not run.daemon_pids()  # it was answered all along: never replaced by one of the run's own


def test_nothing_is_left_by_a_refused_run(node, other_shards, tmp_path):
    marker = tmp_path / "ran"
    first = DaemonProcess({"sample": other_shards}, ("--device", "cpu", "--threads", "1", "--socket-path",
                                                     str(node["socket"]), "--shm-dir", str(node["shm"])),
                          cwd=ROOT, health_address=f"unix:{node['socket']}")
    first.start()
    try:
        _refused(Run([*serve_args(node), "--", "touch", str(marker)], node["env"]), marker)
    finally:
        first.stop()
    nothing_left(node)
