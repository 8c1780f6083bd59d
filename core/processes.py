"""Child processes with limits of their own (dying with their parent, a file size
limit, a gate their parent opens), set without ``preexec_fn``.

``subprocess`` runs a ``preexec_fn`` in a forked copy of the caller, with the
caller's at-fork handlers. In a process where grpc has run, grpc's handler restarts
its event-engine poller in that copy, and the copy closes its descriptors before it
execs: the poller finds its epoll descriptor gone and aborts the child (SIGABRT,
"epoll_wait error: Bad file descriptor"; grpc/grpc#43055). So the limits are set by
a short Python prelude the child runs itself, which then execs the command: the
caller forks no Python code.
"""

from __future__ import annotations

import errno
import os
import shutil
import sys
from collections.abc import Sequence

__all__ = ["limited"]

# argv: parent pid (0: not tied to it), file size limit in bytes (-1: none), gate
# descriptor (-1: none), command. 1 is PR_SET_PDEATHSIG (linux/prctl.h).
_PRELUDE = r"""
import ctypes, os, resource, signal, sys
parent, file_size, gate = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
if parent:
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        sys.exit(1)
if file_size >= 0:
    resource.setrlimit(resource.RLIMIT_FSIZE, (file_size, file_size))
if gate >= 0:
    if not os.read(gate, 1):
        sys.exit(125)  # the parent went before it let the command run
    os.close(gate)
try:
    os.execvp(sys.argv[4], sys.argv[4:])
except OSError as e:
    sys.stderr.write(f"cannot run {sys.argv[4]}: {e.strerror}\n")
    sys.exit(127)
"""


def _why_unrunnable(name: str) -> OSError | None:
    """Why ``name`` (a path, or a name looked up in ``PATH``) cannot be run; None where
    it can (``shutil.which`` says only that it cannot, for a file without its run bit
    as for one that is not there)."""
    if shutil.which(name) is not None:
        return None
    if os.sep in name:
        found: str | None = name
    else:
        folders = os.environ.get("PATH", os.defpath).split(os.pathsep)
        found = next((path for path in (os.path.join(folder, name) for folder in folders)
                      if os.path.exists(path)), None)
    if found is None or not os.path.exists(found):
        return FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), name)
    if os.path.isdir(found):
        return IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), name)
    return PermissionError(errno.EACCES, "not executable: the file has no run permission (chmod +x)", name)


def limited(command: Sequence[str], die_with_parent: bool = False, file_size_bytes: int | None = None,
            gate_fd: int | None = None) -> list[str]:
    """``command`` started through the prelude that sets its limits, for
    ``subprocess.Popen`` (same pid, same arguments once it execs).

    Args:
        die_with_parent: the child gets SIGKILL when its parent dies, even by SIGKILL,
            which leaves the parent no time to stop it (Linux ``prctl``; elsewhere
            nothing). Linux sends it when the *thread* that started the child ends:
            start it from a thread that lives as long as the child should.
        file_size_bytes: ``RLIMIT_FSIZE`` of the child: a write past it fails with
            EFBIG (as on a file system with a size limit).
        gate_fd: the read end of a pipe (pass it in ``pass_fds``): the command runs
            once a byte comes through it, and never if the pipe closes first (status
            125), so the parent can record the child's pid wherever it must before
            the command does anything.

    Raises:
        FileNotFoundError: ``command[0]`` cannot be found, as ``Popen`` would raise it
            (the prelude could only say so in its exit status).
        PermissionError: it is a file without its run bit.
        IsADirectoryError: it is a directory.
    """
    unrunnable = _why_unrunnable(command[0])
    if unrunnable is not None:
        raise unrunnable
    parent = os.getpid() if die_with_parent else 0
    size = -1 if file_size_bytes is None else file_size_bytes
    gate = -1 if gate_fd is None else gate_fd
    return [sys.executable, "-I", "-S", "-c", _PRELUDE, str(parent), str(size), str(gate), *command]
