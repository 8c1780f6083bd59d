"""One batch as the loader holds it between the stream and the device: where its
pixels are (a transport's memory, pinned host memory, or the consumer's GPU), its small
fields, and how its transport memory goes back."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from protocol.batch import BatchMeta
from transport.base import ReceivedBatch

__all__ = ["HostBatch", "PinnedFields", "to_host"]

# Pinned buffers of small fields kept for reuse: the batches a stream queues, plus the
# one being copied, plus slack for a second stream opened ahead.
_FIELDS_KEPT = 32


def _no_release(after: torch.cuda.Event | None = None) -> None:
    """Nothing to hand back (the pixels are not in a transport's memory)."""


class PinnedFields:
    """Pinned host memory for each batch's labels and padding (one int64 ``[2, N]``
    buffer a batch), so a CUDA consumer copies them without blocking and without
    pinning new memory per batch: a buffer is reused once the copy that read it has
    completed (:meth:`give`). Shared by a loader's streams; safe from any thread."""

    def __init__(self) -> None:
        self._free: deque[tuple[torch.cuda.Event | None, torch.Tensor]] = deque()
        self._lock = threading.Lock()
        self.made = 0  # buffers allocated, in all

    def take(self, labels: np.ndarray, padding: np.ndarray) -> torch.Tensor:
        """``[labels, padding]`` as int64 ``[2, N]`` in a pinned buffer free to write."""
        buffer = self._reusable(len(labels))
        if buffer is None:
            buffer = torch.empty((2, max(len(labels), 1)), dtype=torch.int64, pin_memory=True)
            self.made += 1
        fields = buffer[:, : len(labels)]
        fields[0].numpy()[:] = labels
        fields[1].numpy()[:] = padding
        return fields

    def _reusable(self, size: int) -> torch.Tensor | None:
        with self._lock:
            for _ in range(len(self._free)):
                event, buffer = self._free.popleft()
                if buffer.shape[1] >= size and (event is None or event.query()):
                    return buffer
                self._free.append((event, buffer))
        return None

    def give(self, fields: torch.Tensor, after: torch.cuda.Event | None) -> None:
        """``fields`` (from :meth:`take`) may be written again once ``after`` has
        completed (None: now)."""
        base = fields._base if fields._base is not None else fields
        with self._lock:
            self._free.append((after, base))
            while len(self._free) > _FIELDS_KEPT:
                self._free.popleft()


@dataclass(frozen=True)
class HostBatch:
    """One batch as it arrived: in host memory, or on the consumer's GPU (CUDA IPC).

    Attributes:
        images: uint8 ``[N, H, W, 3]``: in host memory (pinned when the consumer is
            on CUDA), or a view of the daemon's device slot on the consumer's GPU.
        labels: int64 ``[N]`` (``meta.labels`` as a tensor, pinned like ``images``).
        padding: ``[N]``, nonzero where a sample is padding (``meta.padding``).
        meta: Every small field of the batch (epoch, cursor, keys, ...), as sent.
        release: Hands the transport's memory back once ``images`` has been copied
            elsewhere (optionally after a CUDA event); without a call it goes back
            when ``images`` is no longer referenced.
        ready: For device ``images``: the event the consumer's stream waits on before
            reading them (the daemon's write). None in host memory.
        fields: The pinned ``[2, N]`` buffer ``labels`` and ``padding`` are rows of
            (None where not pinned): give it back to its :class:`PinnedFields` once
            copied.
    """

    images: torch.Tensor
    labels: torch.Tensor
    padding: torch.Tensor
    meta: BatchMeta
    release: Callable[[torch.cuda.Event | None], None] = field(default=_no_release, repr=False)
    ready: torch.cuda.Event | None = None
    fields: torch.Tensor | None = field(default=None, repr=False)

    def head(self, count: int) -> HostBatch:
        """Its first ``count`` samples (views of the same memory, released as this batch is)."""
        if count >= len(self.meta):
            return self
        meta = replace(self.meta, keys=self.meta.keys[:count], labels=self.meta.labels[:count],
                       padding=self.meta.padding[:count])
        return replace(self, images=self.images[:count], labels=self.labels[:count], padding=self.padding[:count],
                       meta=meta)


def to_host(received: ReceivedBatch, pinned: PinnedFields | None) -> HostBatch:
    """The loader's view of a received batch. The pixels stay where the transport put
    them (a shared-memory slot, the received message, a device slot) unless
    ``pinned`` (a CUDA consumer) and in host memory: a CUDA consumer copies from
    pinned memory without blocking, so they are copied there once and the slot goes
    back at once. Device pixels come with the event that says they are written."""
    meta, images = received.meta, received.images
    release = received.release
    if pinned is not None and images.device.type == "cpu":
        staged = torch.empty(images.shape, dtype=torch.uint8, pin_memory=True)
        staged.copy_(images)
        received.release()
        images, release = staged, _no_release
    if pinned is None:
        labels, padding = torch.from_numpy(meta.labels), torch.from_numpy(meta.padding)
        return HostBatch(images=images, labels=labels, padding=padding, meta=meta, release=release,
                         ready=received.ready)
    fields = pinned.take(meta.labels, meta.padding)
    return HostBatch(images=images, labels=fields[0], padding=fields[1], meta=meta, release=release,
                     ready=received.ready, fields=fields)
