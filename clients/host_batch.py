"""One batch as the loader holds it between the stream and the device: where its
pixels are (a transport's memory, pinned host memory, or the consumer's GPU), its small
fields, and how its transport memory goes back."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from protocol.batch import BatchMeta
from transport.base import ReceivedBatch

__all__ = ["HostBatch", "to_host"]


def _no_release(after: torch.cuda.Event | None = None) -> None:
    """Nothing to hand back (the pixels are not in a transport's memory)."""


@dataclass(frozen=True)
class HostBatch:
    """One batch as it arrived: in host memory, or on the consumer's GPU (CUDA IPC).

    Attributes:
        images: uint8 ``[N, H, W, 3]``: in host memory (pinned when the consumer is
            on CUDA), or a view of the daemon's device slot on the consumer's GPU.
        labels: int64 ``[N]`` (``meta.labels`` as a tensor, pinned like ``images``).
        padding: bool ``[N]`` (``meta.padding`` as a tensor).
        meta: Every small field of the batch (epoch, cursor, keys, ...), as sent.
        release: Hands the transport's memory back once ``images`` has been copied
            elsewhere (optionally after a CUDA event); without a call it goes back
            when ``images`` is no longer referenced.
        ready: For device ``images``: recorded once they may be read (after the
            daemon's write); the consumer's stream waits on it. None in host memory.
    """

    images: torch.Tensor
    labels: torch.Tensor
    padding: torch.Tensor
    meta: BatchMeta
    release: Callable[[torch.cuda.Event | None], None] = field(default=_no_release, repr=False)
    ready: torch.cuda.Event | None = None


def to_host(received: ReceivedBatch, pin: bool) -> HostBatch:
    """The loader's view of a received batch. The pixels stay where the transport put
    them (a shared-memory slot, the received message, a device slot) unless ``pin``
    and in host memory: a CUDA consumer copies from pinned memory without blocking, so
    they are copied there once and the slot goes back at once."""
    meta, images = received.meta, received.images
    release, ready = received.release, None
    if images.device.type == "cuda":
        # The receiver made this thread's stream wait for the daemon's write; the
        # consumer's stream (another thread's) waits on this event in turn.
        ready = torch.cuda.Event()
        ready.record(torch.cuda.current_stream(images.device))
    if pin and images.device.type == "cpu":
        pinned = torch.empty(images.shape, dtype=torch.uint8, pin_memory=True)
        pinned.copy_(images)
        received.release()
        images, release = pinned, _no_release
    labels, padding = torch.from_numpy(meta.labels), torch.from_numpy(meta.padding)
    if pin:
        labels, padding = labels.pin_memory(), padding.pin_memory()
    return HostBatch(images=images, labels=labels, padding=padding, meta=meta, release=release, ready=ready)
