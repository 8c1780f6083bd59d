"""``feeder run``: the per-node launcher, run as a user runs it (a process, real
daemons, a command reading a whole epoch through the address it was given), and
nothing of it left afterwards however the run ends."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from bench.proctree import pids_with_env
from feeder.config_groups import SharedMemory
from launcher.config import RunConfig
from launcher.daemon_process import DaemonProcess
from launcher.run import NodeLauncher
from tests.common.env import ROOT
from tests.common.launcher_runs import N_TRAIN, Run, consumer, nothing_left, serve_args
from tests.common.waiting import wait_for

pytestmark = pytest.mark.slow


def test_the_command_reads_through_the_daemon_it_was_given_and_its_status_is_the_runs(node, tmp_path):
    token = tmp_path / "token"
    token.write_text("s3cret-token\n")
    run = Run([*serve_args(node, "--token-file", str(token)), "--", *consumer(tmp_path)],
              node["env"] | {"STATUS": "3"})
    assert run.wait() == 3
    assert run.out[0] == f"address unix:{node['socket']} token s3cret-token"
    assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"
    assert len(run.daemon_pids()) == 1 and run.said("ready in")
    nothing_left(node)


def test_a_daemon_that_cannot_start_ends_the_run_in_one_line_and_the_command_never_runs(node, tmp_path):
    empty = tmp_path / "not-shards"
    empty.mkdir()
    marker = tmp_path / "ran"
    args = [a if a != f"sample={node['shards']}" else f"sample={empty}" for a in serve_args(node)]
    run = Run([*args, "--start-timeout-s", "60", "--", "touch", str(marker)], node["env"])
    assert run.wait() == 1
    errors = run.said("feeder: error:")
    assert len(errors) == 1 and "feeder serve did not start" in errors[0] and str(empty) in errors[0]
    assert not marker.exists()
    nothing_left(node)


def test_a_command_that_cannot_run_is_one_line_and_the_daemon_is_stopped(node):
    run = Run([*serve_args(node), "--", "/no/such/trainer"], node["env"])
    assert run.wait() == 1
    assert run.said("feeder: error: command: cannot run /no/such/trainer")
    nothing_left(node)


def test_a_command_without_its_run_bit_is_said_to_be_not_executable(node, tmp_path):
    # Before: "No such file or directory", of a file that is there.
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\ntrue\n")
    script.chmod(0o644)
    run = Run([*serve_args(node), "--", str(script)], node["env"])
    assert run.wait() == 1
    errors = [line for line in run.err if line.startswith("feeder: error:")]
    assert errors == [f"feeder: error: command: cannot run {script} (not executable: the file has no run permission "
                      "(chmod +x))"], run.err
    nothing_left(node)


def test_bad_launcher_options_are_refused_before_anything_starts(node):
    for bad, message in ((["--restarts", "-1"], "restarts: must be >= 0"),
                         (["--pool-with", "nohost"], "pool_with: 'nohost' is not HOST:PORT"),
                         ([], "command: give it after --")):
        run = Run([*serve_args(node), *bad, *([] if not bad else ["--", "true"])], node["env"])
        assert run.wait() == 1
        errors = [line for line in run.err if line.startswith("feeder: error:")]
        assert len(errors) == 1 and message in errors[0], run.err
        assert not run.daemon_pids()
    nothing_left(node)


def test_a_daemon_already_serving_on_the_socket_is_used_and_left_running(node, tmp_path):
    first = DaemonProcess({"sample": node["shards"]}, ("--device", "cpu", "--threads", "1", "--socket-path",
                                                       str(node["socket"]), "--shm-dir", str(node["shm"])),
                          cwd=ROOT, health_address=f"unix:{node['socket']}")
    first.start()
    try:
        run = Run([*serve_args(node), "--", *consumer(tmp_path)], node["env"])
        assert run.wait() == 0
        assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"
        assert run.said(f"using the daemon already serving on unix:{node['socket']}") and not run.daemon_pids()
        assert first.returncode is None  # not the run's to stop

        other = Run([*serve_args(node), "--dataset", "imagenet=/nowhere", "--", "true"], node["env"])
        assert other.wait() == 1
        assert other.said("does not serve imagenet")
    finally:
        first.stop()
    nothing_left(node)


def test_a_daemon_killed_mid_epoch_is_started_again_and_the_epoch_stays_whole(node, tmp_path):
    run = Run([*serve_args(node), "--", *consumer(tmp_path)], node["env"] | {"PAUSE_S": "0.1"})
    assert wait_for(lambda: node["progress"].exists() and int(node["progress"].read_text() or 0) >= 12,
                    timeout_s=90)
    os.kill(run.daemon_pids()[0], signal.SIGKILL)
    assert run.wait() == 0
    assert run.out[-1] == f"samples {N_TRAIN} most 1 shm"  # every sample once across the restart
    assert len(run.said("the daemon is gone (SIGKILL); starting one again in 1 s (restart 1 of 5)")) == 1
    assert run.reconnects() >= 1  # the kill came while the daemon still owed batches
    assert len(run.daemon_pids()) == 2
    nothing_left(node)  # the killed daemon's segments too


def test_sigterm_reaches_the_command_and_the_daemon_is_stopped_after_it(node, tmp_path):
    run = Run([*serve_args(node), "--", *consumer(tmp_path)],
              node["env"] | {"PAUSE_S": "0.5", "ON_TERM": "7"})
    assert wait_for(lambda: node["progress"].exists(), timeout_s=90)
    run.proc.send_signal(signal.SIGTERM)
    assert run.wait() == 7  # the command's own status
    nothing_left(node)


def test_a_command_killed_by_a_signal_is_reported_as_a_shell_does(node):
    run = Run([*serve_args(node), "--", "sh", "-c", "kill -9 $$"], node["env"])
    assert run.wait() == 128 + signal.SIGKILL
    nothing_left(node)


def test_a_node_shared_by_two_runs_keeps_serving_when_the_first_run_ends(node, tmp_path):
    # The first run's command ends once the second's has read a batch from the shared
    # daemon (a fixed sleep could end before a slow start on a busy machine read any),
    # and the second's epoch (24 batches, 0.5 s each) outlasts the first run.
    until_read = f'until [ -e "{node["progress"]}" ]; do sleep 0.1; done; sleep 1'
    first = Run([*serve_args(node), "--", "sh", "-c", until_read], node["env"])
    assert wait_for(lambda: bool(first.daemon_pids()), timeout_s=90)
    second = Run([*serve_args(node), "--", *consumer(tmp_path)], node["env"] | {"PAUSE_S": "0.5"})
    assert first.wait() == 0  # and stops the daemon it started, under the second's stream
    assert second.wait() == 0
    assert second.said("using the daemon already serving on")
    assert second.said("the daemon is gone (the shared one stopped answering); starting one again")
    assert len(second.daemon_pids()) == 1  # its own, from then on
    assert second.reconnects() >= 1  # its stream went from the shared daemon to its own mid-epoch
    assert second.out[-1] == f"samples {N_TRAIN} most 1 shm"
    nothing_left(node)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped is not)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def test_a_launcher_killed_outright_takes_its_command_and_leaves_nothing(node, tmp_path):
    pid_file = tmp_path / "command.pid"
    run = Run([*serve_args(node), "--", "sh", "-c", f"echo $$ > {pid_file}; exec sleep 600"], node["env"])
    assert wait_for(lambda: pid_file.exists() and bool(pid_file.read_text().strip()), timeout_s=90)
    command, (daemon,) = int(pid_file.read_text()), run.daemon_pids()
    run.proc.kill()
    assert run.wait() == -signal.SIGKILL  # the launcher had no chance to stop anything itself
    assert wait_for(lambda: not _alive(command), timeout_s=30), "the command outlived its launcher"
    assert wait_for(lambda: not _alive(daemon), timeout_s=30)
    assert wait_for(lambda: not node["socket"].exists(), timeout_s=30), "the socket file stayed"
    assert run.said("the launcher is gone; ending its command")
    assert wait_for(lambda: not pids_with_env("FEEDER_TEST_RUN", node["mark"]), timeout_s=30)
    nothing_left(node)


def test_a_daemon_killed_with_no_restarts_left_leaves_no_socket(node, tmp_path):
    stop = tmp_path / "stop"
    run = Run([*serve_args(node, "--restarts", "0"), "--", "sh", "-c",
               f"while [ ! -e {stop} ]; do sleep 0.1; done"], node["env"])
    assert wait_for(lambda: bool(run.daemon_pids()), timeout_s=90)
    assert node["socket"].exists()
    os.kill(run.daemon_pids()[0], signal.SIGKILL)
    assert wait_for(lambda: bool(run.said("the daemon is gone (SIGKILL) and was started again 0 times; not again")),
                    timeout_s=30)
    assert wait_for(lambda: not node["socket"].exists(), timeout_s=10), "the dead daemon's socket stayed"
    assert run.proc.poll() is None  # swept while the command still runs
    stop.touch()
    assert run.wait() == 0
    nothing_left(node)


def test_a_daemon_that_must_be_killed_at_the_end_leaves_no_socket(node):
    """A daemon that does not stop on SIGTERM (here: frozen) gets SIGKILL after its
    grace, which leaves its socket file: the launcher sweeps it as it would a daemon
    that died while the command ran."""
    config = RunConfig(datasets={"sample": node["shards"]}, device="cpu", port=0, grace_s=0.0,
                       socket_path=node["socket"], shm=SharedMemory(shm_dir=node["shm"]))
    launcher = NodeLauncher(config, serve_args(node, "--grace-s", "0"), ["true"], say=lambda _: None)
    launcher._have_daemon()
    assert launcher.daemon is not None and node["socket"].exists()
    os.kill(launcher.daemon.pid, signal.SIGSTOP)
    launcher._stop_daemon()
    assert launcher.daemon.returncode == -signal.SIGKILL  # the SIGTERM did not end it
    nothing_left(node)
