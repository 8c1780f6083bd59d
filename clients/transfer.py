"""Host or device batch to the consumer's device tensors: copy uint8, then convert and
normalise there in one pass (:mod:`clients.normalize`).

Moving uint8 and converting on the device moves 4x fewer bytes than float32. On CUDA
a host batch is copied without blocking from pinned memory on a side stream, and the
consumer's stream waits for it only when it uses the tensors. A batch already on the
GPU (a CUDA IPC slot) is not copied to the device: the consumer's stream waits on the
batch's ready event (never the host), and it is converted where it is into memory of
the consumer's own, so the slot can go back right after.
"""

from __future__ import annotations

import torch

from clients.normalize import normalize as normalize_images

__all__ = ["IMAGENET_MEAN", "IMAGENET_STD", "DeviceTransfer"]

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


class DeviceTransfer:
    """Moves NHWC uint8 images to ``device`` as NCHW tensors.

    Args:
        device: Where the tensors go.
        normalize: Convert to ``dtype`` and normalise with the ImageNet mean/std;
            otherwise images stay uint8 (0-255).
        channels_last: Keep the NHWC memory layout behind the NCHW shape (what
            convolutions prefer); otherwise make them contiguous NCHW.
        dtype: Floating dtype of normalised images (a trainer's autocast dtype saves
            the conversion its first layer would make).
    """

    def __init__(
        self,
        device: torch.device,
        normalize: bool = True,
        channels_last: bool = True,
        dtype: torch.dtype = torch.float32,
    ) -> None:
        self.device = device
        self.normalize = normalize
        self.channels_last = channels_last
        self.dtype = dtype
        # mean and 1/std per channel on the 0-255 scale, fp32
        self._mean = torch.tensor(IMAGENET_MEAN, device=device).mul_(255)
        self._inv_std = torch.tensor(IMAGENET_STD, device=device).mul_(255).reciprocal_()
        self._side = torch.cuda.Stream(device) if device.type == "cuda" else None
        if self._side is not None:  # it reads mean and 1/std, written on the current stream
            self._side.wait_stream(torch.cuda.current_stream(device))
        # Recorded after the last read of a batch's tensors (None: reads were synchronous).
        self.copied: torch.cuda.Event | None = None

    def __call__(
        self, images: torch.Tensor, *others: torch.Tensor, ready: torch.cuda.Event | None = None
    ) -> tuple[torch.Tensor, ...]:
        """Copies ``images`` (uint8 NHWC) and ``others`` (labels, masks) to the device.

        Args:
            images: in host memory, or already on a GPU (then never returned as is:
                the result owns its memory).
            others: small tensors, in host memory.
            ready: for ``images`` on a GPU, the event the current stream waits on
                before reading them.

        Returns:
            ``(images [N, 3, H, W], *others)`` on the device. ``copied`` is then
            recorded after the last read of ``images`` and ``others``.
        """
        if images.device.type == "cuda" and self.device.type == "cuda":
            return self._from_device(images, others, ready)
        if self._side is None:
            return (self._convert(images.to(self.device)),
                    *(t.to(self.device) for t in others))
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._side):
            moved = [t.to(self.device, non_blocking=True) for t in (images, *others)]
            self.copied = torch.cuda.Event()
            self.copied.record(self._side)  # the host memory may be reused after this
            moved[0] = self._convert(moved[0])
        current.wait_stream(self._side)
        for tensor in moved:
            tensor.record_stream(current)  # memory belongs to the consumer's stream now
        return tuple(moved)

    def _from_device(
        self, images: torch.Tensor, others: tuple[torch.Tensor, ...], ready: torch.cuda.Event | None
    ) -> tuple[torch.Tensor, ...]:
        stream = torch.cuda.current_stream(self.device)
        if ready is not None:
            stream.wait_event(ready)
        if self.normalize:
            out = self._convert(images if images.device == self.device else images.to(self.device))
        else:  # uint8 as is: one copy out of the slot
            nchw = images.permute(0, 3, 1, 2)
            out = nchw.clone(memory_format=torch.channels_last if self.channels_last else torch.contiguous_format)
        moved = tuple(t.to(self.device, non_blocking=True) for t in others)
        self.copied = torch.cuda.Event()
        self.copied.record(stream)  # the slot and the pinned fields are not read after this
        return (out, *moved)

    def _convert(self, nhwc: torch.Tensor) -> torch.Tensor:
        if not self.normalize:
            images = nhwc.permute(0, 3, 1, 2)  # NCHW shape over NHWC memory = channels_last
            return images if self.channels_last else images.contiguous()
        return normalize_images(nhwc.contiguous(), self._mean, self._inv_std, self.dtype, self.channels_last)
