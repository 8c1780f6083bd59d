"""Stopping a training run on SIGTERM with a checkpoint first: what a scheduler
sends before it kills a job it preempts, requeues or cancels (Slurm: SIGTERM, then
SIGKILL after ``KillWait``; Kubernetes: SIGTERM, then SIGKILL after the pod's grace
period). A rank that gets the signal only says so; every few steps the ranks agree
(one all-reduce of one number) on whether any got it, so all of them stop after the
same step, and the job checkpoints there and exits: ``--resume`` goes on from that
step instead of from the last periodic checkpoint.

The agreement never waits on the GPU: it is an all-reduce of a host tensor on a gloo
process group of its own, started without waiting (``async_op``) at one check and
read at the next, by when it is long done. So a stop takes effect at most two checks
after the signal (8 steps, well within a second at any real step rate), and the GPU's
queue of steps is never drained for it.
"""

from __future__ import annotations

import signal
from types import FrameType
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["CHECK_EVERY_STEPS", "StopRequests", "Stopped"]

# How often the ranks agree on a stop (an all-reduce of one number): often enough to
# stop within a second of the signal at any real step rate.
CHECK_EVERY_STEPS = 4
_SIGNALS = (signal.SIGTERM,)


class Stopped(Exception):  # noqa: N818 - what happened, not an error
    """The run stopped on ``signum`` after a checkpoint at ``step``."""

    def __init__(self, signum: int, step: int) -> None:
        super().__init__(f"stopped on {signal.Signals(signum).name} at step {step}")
        self.signum, self.step = signum, step


class StopRequests:
    """SIGTERM noted while the block runs (a context manager); the signal's
    previous handlers come back after it.

    Args:
        device: unused (the agreement is on the host); kept for the callers' sake.
        group: the process group the ranks agree on (a gloo group: host tensors);
            None: the default group.
    """

    def __init__(self, device: torch.device | None = None, group: object | None = None) -> None:
        self.device = device
        self.group = group
        self.signum = 0
        self._previous: dict[int, object] = {}
        self._pending: tuple[object, torch.Tensor] | None = None  # an all-reduce started, not read

    def __enter__(self) -> StopRequests:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._pending = None

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = self.signum or signum

    def agreed(self, step: int) -> int:
        """The signal any rank got (0: none), as all ranks agreed at the check before
        this one; every ``CHECK_EVERY_STEPS`` steps it reads that agreement and starts
        the next (a collective: every rank calls it at every step)."""
        if not dist.is_initialized():
            return self.signum
        if step % CHECK_EVERY_STEPS:
            return 0
        agreed = 0
        if self._pending is not None:
            work, flag = self._pending
            work.wait()  # type: ignore[attr-defined]  # started a check ago: done by now
            agreed = int(flag.item())  # a host tensor: no GPU synchronisation
        flag = torch.tensor([self.signum], dtype=torch.int64)
        group: Any = self.group
        self._pending = (dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group, async_op=True), flag)
        return agreed
