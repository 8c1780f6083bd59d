"""Writing decoded batches into a device slot with no host wait: copies are enqueued
on the slot's stream (the daemon's own, see :mod:`transport.cuda_ipc`), and what a
copy reads (a DALI output, a pinned staging buffer) is kept until an event recorded
after it has completed, checked without waiting (:class:`Held`).

GPU only; the module imports torch.cuda lazily, so the CPU path never touches it.
"""

from __future__ import annotations

import ctypes
from collections import deque
from typing import Any

import torch

from core.errors import FeederError

__all__ = ["Held", "PinnedStaging", "copy_dali_output", "upload"]

# Pinned staging buffers kept for reuse: runs in flight plus the one being written.
_STAGING_KEPT = 4


class Held:
    """What enqueued device copies still read, each with the event that says they
    are done; let go of once the event has completed (:meth:`prune`, never a wait)."""

    def __init__(self) -> None:
        self._held: deque[tuple[torch.cuda.Event, tuple[Any, ...]]] = deque()

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, stream: torch.cuda.Stream, *things: Any) -> torch.cuda.Event:
        """Keeps ``things`` until the work enqueued on ``stream`` so far is done;
        returns the event recorded there."""
        event = torch.cuda.Event()
        event.record(stream)
        self._held.append((event, things))
        self.prune()
        return event

    def prune(self) -> None:
        """Lets go of what completed copies read (in order: events on one stream
        complete in order, and on several nearly so)."""
        while self._held and self._held[0][0].query():
            self._held.popleft()

    def drain(self) -> None:
        """Waits for every copy and lets go of everything (a pipeline going idle)."""
        while self._held:
            event, _ = self._held.popleft()
            event.synchronize()


class PinnedStaging:
    """Pinned host buffers for batches decoded on the CPU and uploaded into a device
    slot: a buffer is reused once its upload has completed, so a steady stream
    allocates none."""

    def __init__(self) -> None:
        self._free: deque[tuple[torch.cuda.Event, torch.Tensor]] = deque()

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes``, free to write."""
        for _ in range(len(self._free)):
            event, buffer = self._free.popleft()
            if buffer.numel() >= nbytes and event.query():
                return buffer
            self._free.append((event, buffer))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buffer: torch.Tensor, stream: torch.cuda.Stream) -> None:
        """``buffer`` is read by work enqueued on ``stream``: free once it is done."""
        event = torch.cuda.Event()
        event.record(stream)
        self._free.append((event, buffer))
        while len(self._free) > _STAGING_KEPT:
            self._free.popleft()  # the oldest: the caching host allocator takes it back after its event

    def clear(self) -> None:
        self._free.clear()


def upload(pixels: torch.Tensor, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Enqueues the copy of ``pixels`` (pinned host memory) into ``dst`` on ``stream``."""
    with torch.cuda.stream(stream):
        dst.copy_(pixels.view(dst.shape), non_blocking=True)


def copy_dali_output(out: Any, dst: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """DALI's GPU output (a TensorListGPU of equal-shaped samples, bound to a stream
    ``stream`` has waited for) into ``dst``, a contiguous uint8 CUDA tensor, device
    to device, enqueued on ``stream`` (the caller keeps ``out`` until it is done).

    Raises:
        FeederError: the output does not fit ``dst``.
    """
    shapes = [list(s) for s in out.shape()]
    if not dst.is_contiguous() or shapes != [list(dst.shape[1:])] * int(dst.shape[0]):
        raise FeederError(f"device output of {len(shapes)} samples does not fit {list(dst.shape)}")
    out.copy_to_external(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(stream.cuda_stream), non_blocking=True)
