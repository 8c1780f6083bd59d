"""What a loader measures of the loop that iterates it: time spent waiting for data,
the device's idle time between steps, samples the daemon could not serve."""

from __future__ import annotations

import torch

from clients.idle import IdleShare, StepGaps

__all__ = ["LoaderFigures"]


class LoaderFigures:
    """The figures of a loader's current (or last) epoch and of its whole life.

    Attributes:
        wait_seconds: seconds the loop has waited for batches, in all.
    """

    def __init__(self, device: torch.device) -> None:
        self.wait_seconds = 0.0
        self._skipped = 0
        self._epoch_wait_s = self._epoch_wall_s = self._epoch_longest_s = 0.0
        self._gaps = StepGaps(device)

    @property
    def skipped(self) -> int:
        """Samples the daemon could not serve (undecodable, or over its pixel cap) that
        arrived replaced by a repeat of another sample of their batch, marked as
        padding (``feeder serve --on-error skip``); the daemon logs and names them."""
        return self._skipped

    @property
    def stall_fraction(self) -> float:
        """Share of the current (or last) epoch's iteration time spent waiting for data."""
        return self._epoch_wait_s / self._epoch_wall_s if self._epoch_wall_s > 0 else 0.0

    @property
    def device_idle(self) -> IdleShare:
        """The device's idle time between the steps of the current (or last) epoch and
        its busy time in them (:mod:`clients.idle`): a step runs from the moment a
        batch is handed over until the next is asked for, and the device's idle time
        is what the loader costs it (waiting for data and preparing it). On CUDA it
        is read from events on the consumer's stream once they have completed, never
        with a synchronisation; on the CPU it is wall-clock time."""
        return self._gaps.share()

    @property
    def longest_wait_s(self) -> float:
        """The longest wait for one batch in the current (or last) epoch, past its first
        (which waits on the streams' start too): what a daemon lost costs the loop."""
        return self._epoch_longest_s

    def _pass_began(self) -> None:
        self._epoch_wait_s = self._epoch_wall_s = self._epoch_longest_s = 0.0
        self._gaps.reset()

    def _account(self, wait_s: float, wall_s: float, first: bool) -> None:
        self.wait_seconds += wait_s
        self._epoch_wait_s += wait_s
        self._epoch_wall_s = wall_s
        if not first:  # the first waits on the stream's start as well
            self._epoch_longest_s = max(self._epoch_longest_s, wait_s)
