"""What ends ``feeder run``'s command when the launcher itself is killed outright.

A launcher killed with SIGKILL (the OOM killer, ``kill -9``) cannot stop anything.
Its daemon goes with it (the parent-death signal, :mod:`core.processes`), but the
command (a trainer holding GPUs) would run on, reparented to init, until its loaders
give up, and the daemon's socket and segments would stay. So each launcher starts a
guard before its command: a small process in a session of its own that reads a pipe
only the launcher holds open. The launcher writes each daemon's pid into it, and the
command's process group before it lets the command run (:func:`core.processes.limited`'s
gate), and ``done`` once the command has exited and its daemon is stopped; the guard
then exits. When the pipe closes without ``done`` the launcher is
gone, and the guard ends the command's process group (SIGTERM, SIGKILL after
``grace_s``), waits for the daemon to be gone, and sweeps what it left (socket file,
shared-memory segments).

Run as ``python -m launcher.guard FD GRACE_S SHM_DIR [SOCKET_PATH]``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from feeder.socket_claim import sweep_socket

__all__ = ["LauncherGuard", "main", "sweep_leftovers"]

_POLL_S = 0.1
_DAEMON_GONE_S = 10.0  # how long the guard waits for a daemon killed by its parent-death signal


def sweep_leftovers(socket_path: Path | None, shm_dir: Path) -> None:
    """Remove what a daemon killed outright left: its socket file (when nobody holds
    the socket and nothing answers on it) and the segments nobody holds."""
    if socket_path is not None:
        sweep_socket(socket_path)
    from transport.shm import sweep_stale  # torch: loaded only when there is something to sweep

    if shm_dir.is_dir():
        sweep_stale(shm_dir)


class LauncherGuard:
    """The launcher's half: starts the guard and tells it what to end.

    Args:
        grace_s: how long the command gets after SIGTERM before SIGKILL.
        shm_dir: the shared-memory directory of the launcher's daemon.
        socket_path: the launcher's daemon's socket, if it has one.
    """

    def __init__(self, grace_s: float, shm_dir: Path, socket_path: Path | None) -> None:
        read, self._write = os.pipe()  # neither end is inherited by the daemon or the command
        command = [sys.executable, "-m", "launcher.guard", str(read), str(grace_s), str(shm_dir)]
        if socket_path is not None:
            command.append(str(socket_path))
        try:
            # Its lines go to the launcher's stderr; it holds no pipe of the command's output.
            self._proc = subprocess.Popen(command, pass_fds=(read,), stdin=subprocess.DEVNULL,
                                          stdout=subprocess.DEVNULL, start_new_session=True)
        finally:
            os.close(read)

    def command(self, group: int) -> None:
        """The command runs in process group ``group``."""
        self._say(f"command {group}")

    def daemon(self, pid: int) -> None:
        """This launcher's daemon is now ``pid``."""
        self._say(f"daemon {pid}")

    def close(self, command_ended: bool) -> None:
        """The launcher is leaving: when ``command_ended`` (and its daemon stopped) the
        guard exits doing nothing; else it ends the command as if the launcher had died."""
        if self._write < 0:
            return
        if command_ended:
            self._say("done")
        os.close(self._write)
        self._write = -1
        self._proc.wait()

    def _say(self, line: str) -> None:
        try:
            os.write(self._write, f"{line}\n".encode())
        except OSError:
            pass  # the guard is gone (killed by hand): nothing to tell


@dataclass
class _Watched:
    group: int = 0  # the command's process group (0: none yet)
    daemon: int = 0  # the launcher's latest daemon (0: none, or a shared one)
    done: bool = False


def _read(fd: int) -> _Watched:
    """What the launcher said, until it said ``done`` or closed the pipe."""
    watched = _Watched()
    with os.fdopen(fd, "r") as pipe:
        for line in pipe:
            word, _, value = line.strip().partition(" ")
            if word == "command":
                watched.group = int(value)
            elif word == "daemon":
                watched.daemon = int(value)
            elif word == "done":
                watched.done = True
                break
    return watched


def _gone(alive: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while alive():
        if time.monotonic() >= deadline:
            return False
        time.sleep(_POLL_S)
    return True


def _group_alive(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _pid_alive(pid: int) -> bool:
    """Whether any thread of process ``pid`` is still running. A killed process's main
    thread is a zombie before its other threads have exited, and its descriptors (the
    socket's claim, the segments' locks) go only with the last of them."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return False
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X"):
                    return True
        except (FileNotFoundError, ProcessLookupError, IndexError):
            continue
    return False


def _signal_group(group: int, signum: signal.Signals) -> None:
    try:
        os.killpg(group, signum)
    except (ProcessLookupError, PermissionError):
        pass


def _say(text: str) -> None:
    print(f"feeder run: {text}", file=sys.stderr, flush=True)


def _end(watched: _Watched, grace_s: float, shm_dir: Path, socket_path: Path | None) -> None:
    _say(f"the launcher is gone; ending its command (process group {watched.group or '-'})")
    if watched.group:
        _signal_group(watched.group, signal.SIGTERM)
    if watched.daemon:
        _gone(lambda: _pid_alive(watched.daemon), _DAEMON_GONE_S)
        sweep_leftovers(socket_path, shm_dir)
    if watched.group and not _gone(lambda: _group_alive(watched.group), grace_s):
        _say(f"the command did not end {grace_s:g} s after SIGTERM; SIGKILL")
        _signal_group(watched.group, signal.SIGKILL)


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    fd, grace_s, shm_dir = int(args[0]), float(args[1]), Path(args[2])
    socket_path = Path(args[3]) if len(args) > 3 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is the launcher's to handle
    watched = _read(fd)
    if not watched.done:
        _end(watched, grace_s, shm_dir, socket_path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
