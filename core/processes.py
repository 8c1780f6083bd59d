"""Child processes that do not outlive their parent."""

from __future__ import annotations

import ctypes
import signal

__all__ = ["die_with_parent"]

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent() -> None:
    """Makes this process get SIGKILL when its parent dies, even by SIGKILL, which
    leaves the parent no time to stop it (Linux ``prctl``; elsewhere nothing).

    Meant as ``subprocess.Popen(preexec_fn=die_with_parent)``. Linux sends the signal
    when the *thread* that started the child ends: start it from a thread that lives
    as long as the child should (the main thread).
    """
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):
        pass
