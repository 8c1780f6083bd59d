"""How long a training loop's device stood idle between its steps: the data stall as
the accelerator sees it.

Host time blocked on the loader cannot see a GPU stall: while the host waits, the GPU
may still be working through steps queued earlier, and a GPU slowed by other work
(decoding kernels sharing its SMs) shows no host wait at all. So each step is
bracketed by two marks on the device's current stream, one when its first work is
enqueued (:meth:`StepGaps.started`) and one after its last (:meth:`StepGaps.ended`).
On CUDA the marks are timing events: the device's idle time between steps is the time
between one step's end and the next one's start *as the GPU ran them*, and its busy
time the time from a start to its end; both are read once the events have completed
(``query()``), never with a synchronisation. On the CPU the marks are wall-clock
readings, so the idle time is the host's time between steps (what it waited for data
and spent preparing it).

Compared with the same loop on synthetic data (DS-Analyzer's and CoorDL's method),
the difference in idle share is what the input pipeline costs the step.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass

import torch

__all__ = ["IdleShare", "StepGaps"]


@dataclass(frozen=True)
class IdleShare:
    """Idle and busy seconds of the device over completed steps.

    Attributes:
        idle_s: between one step's end and the next one's start.
        busy_s: from each step's start to its end.
        steps: steps counted.
    """

    idle_s: float = 0.0
    busy_s: float = 0.0
    steps: int = 0

    @property
    def fraction(self) -> float:
        """Share of the time the device stood idle between steps (0 with no steps)."""
        total = self.idle_s + self.busy_s
        return self.idle_s / total if total > 0 else 0.0


class StepGaps:
    """Marks around each step of a loop on ``device`` and what they show (see the
    module doc). Call :meth:`started` before a step's first work and :meth:`ended`
    after its last; :meth:`share` reads what has completed, without waiting;
    :meth:`reset` starts a new count (an epoch)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._marks: deque[tuple[str, object]] = deque()  # ("start" | "end", event or seconds)
        self._last_end: object | None = None  # the previous step's end, once read
        self._idle_s = self._busy_s = 0.0
        self._steps = 0
        self._open_start: object | None = None  # a start whose end is not read yet

    def started(self) -> None:
        """A step's first work is about to be enqueued."""
        self._marks.append(("start", self._mark()))

    def ended(self) -> None:
        """A step's last work has been enqueued."""
        self._marks.append(("end", self._mark()))

    def _mark(self) -> object:
        if not self._cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def share(self) -> IdleShare:
        """Idle and busy time over the steps whose marks have completed."""
        while self._marks and self._done(self._marks[0][1]):
            kind, mark = self._marks.popleft()
            if kind == "start":
                if self._last_end is not None:
                    self._idle_s += self._seconds(self._last_end, mark)
                    self._last_end = None
                self._open_start = mark
            elif self._open_start is not None:
                self._busy_s += self._seconds(self._open_start, mark)
                self._steps += 1
                self._open_start, self._last_end = None, mark
        return IdleShare(self._idle_s, self._busy_s, self._steps)

    def reset(self) -> None:
        """Counts from the next step on (what is pending now is dropped)."""
        self._marks.clear()
        self._last_end = self._open_start = None
        self._idle_s = self._busy_s = 0.0
        self._steps = 0

    def _done(self, mark: object) -> bool:
        return not self._cuda or bool(mark.query())  # type: ignore[attr-defined]

    def _seconds(self, first: object, second: object) -> float:
        if not self._cuda:
            return max(0.0, float(second) - float(first))  # type: ignore[arg-type]
        return max(0.0, first.elapsed_time(second) / 1000.0)  # type: ignore[attr-defined]
