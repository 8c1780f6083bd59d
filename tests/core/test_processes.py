"""``core.processes.limited``: the child sets its own limits, then execs the command
(same pid, same arguments), so its parent forks no Python code."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from core.processes import limited

_SHOW = ("import ctypes, os, resource, sys; pdeath = ctypes.c_int(); "
         "ctypes.CDLL(None).prctl(2, ctypes.byref(pdeath), 0, 0, 0); "  # PR_GET_PDEATHSIG
         "print(os.getpid(), pdeath.value, resource.getrlimit(resource.RLIMIT_FSIZE)[0], sys.argv[1:])")


def _shown(command: list[str]) -> tuple[int, list[str]]:
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    pid, *rest = out.split(" ", 1)
    assert int(pid) == proc.pid  # exec'd in place: the same process
    return proc.pid, rest


def test_the_command_runs_in_place_with_its_limits_and_arguments():
    _, (shown,) = _shown(limited([sys.executable, "-c", _SHOW, "a b", "-c"], die_with_parent=True,
                                 file_size_bytes=40_000))
    assert shown.strip() == f"{int(signal.SIGKILL)} 40000 ['a b', '-c']"


def test_without_limits_the_command_runs_unchanged():
    _, (shown,) = _shown(limited([sys.executable, "-c", _SHOW]))
    unlimited = subprocess.run([sys.executable, "-c", "import resource; print(resource.getrlimit("
                                "resource.RLIMIT_FSIZE)[0])"], capture_output=True, text=True).stdout.strip()
    assert shown.strip() == f"0 {unlimited} []"


@pytest.mark.slow
def test_a_child_of_a_process_where_grpc_ran_starts():
    # grpc's at-fork handler restarts its poller in a forked copy of the caller, which
    # aborts once the copy closes its descriptors: the prelude forks no Python code.
    import grpc

    with grpc.insecure_channel("127.0.0.1:1") as channel:
        with pytest.raises(grpc.FutureTimeoutError):
            grpc.channel_ready_future(channel).result(timeout=0.2)  # its poller runs
        codes = [subprocess.run(limited([sys.executable, "-c", "pass"], die_with_parent=True)).returncode
                 for _ in range(20)]
    assert codes == [0] * 20


def test_a_command_that_cannot_be_found_is_refused_as_popen_would(tmp_path):
    gone = str(tmp_path / "venv" / "bin" / "python")
    with pytest.raises(FileNotFoundError) as caught:
        limited([gone, "-c", "pass"])
    assert caught.value.filename == gone


def test_a_command_without_its_run_bit_is_refused_as_not_executable(tmp_path, monkeypatch):
    # Before: "No such file or directory" for a file that is there.
    script = tmp_path / "train.sh"
    script.write_text("#!/bin/sh\necho trained\n")
    script.chmod(0o644)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ.get('PATH', '')}")
    for name in ("./train.sh", str(script), "train.sh"):
        with pytest.raises(PermissionError) as caught:
            limited([name])
        assert caught.value.filename == name and caught.value.strerror.startswith("not executable")
    with pytest.raises(IsADirectoryError):
        limited([str(tmp_path)])
    script.chmod(0o755)
    assert subprocess.run(limited(["./train.sh"]), capture_output=True, text=True).stdout == "trained\n"


def test_a_gated_command_runs_once_let_and_never_if_its_gate_closes_first(tmp_path):
    import os

    for let in (True, False):
        marker = tmp_path / f"ran-{let}"
        read, write = os.pipe()
        proc = subprocess.Popen(limited(["touch", str(marker)], gate_fd=read), pass_fds=(read,))
        os.close(read)
        if let:
            os.write(write, b"x")
        os.close(write)
        assert proc.wait(60) == (0 if let else 125)
        assert marker.exists() is let
