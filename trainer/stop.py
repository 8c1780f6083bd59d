"""Stopping a training run on SIGTERM with a checkpoint first: what a scheduler
sends before it kills a job it preempts, requeues or cancels (Slurm: SIGTERM, then
SIGKILL after ``KillWait``; Kubernetes: SIGTERM, then SIGKILL after the pod's grace
period). A rank that gets the signal only says so; every few steps the ranks agree
(one all-reduce of one number) on whether any got it, so all of them stop after the
same step, and the job checkpoints there and exits: ``--resume`` goes on from that
step instead of from the last periodic checkpoint."""

from __future__ import annotations

import signal
from types import FrameType

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
    previous handlers come back after it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.signum = 0
        self._previous: dict[int, object] = {}

    def __enter__(self) -> StopRequests:
        for sig in _SIGNALS:
            self._previous[sig] = signal.signal(sig, self._note)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]

    def _note(self, signum: int, _frame: FrameType | None) -> None:
        self.signum = self.signum or signum

    def agreed(self, step: int) -> int:
        """The signal any rank got (0: none), agreed by all every ``CHECK_EVERY_STEPS``
        steps (a collective: every rank calls it at every step)."""
        if not dist.is_initialized():
            return self.signum
        if step % CHECK_EVERY_STEPS:
            return 0
        flag = torch.tensor([self.signum], dtype=torch.int64, device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())
