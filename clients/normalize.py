"""uint8 NHWC images to normalised ``[N, 3, H, W]`` tensors of the training dtype, in
one pass over the pixels.

On CUDA this is one kernel (Triton, which ships with torch's CUDA builds): each
byte is read once, converted, normalised with its channel's mean and standard
deviation and written once in the output dtype (bf16, fp16 or fp32), in the
channels-last layout or the contiguous one. torch's own ops take four to five
passes (convert, subtract, multiply, convert again, or a clone). Elsewhere, or where
Triton cannot run, the same arithmetic in torch ops (:func:`normalize_with_torch`).
Both compute in fp32 and round once, so they give the same values.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

__all__ = ["normalize", "normalize_with_torch"]

_log = logging.getLogger(__name__)
_BLOCK = 2048  # elements per program: a multiple of the 3 channels is not needed (c = i % 3)
_kernel: Any = None  # the compiled Triton kernel, made on first use
_kernel_failed = ""  # why the kernel cannot run here (then torch's ops do it)


def normalize(images: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, dtype: torch.dtype,
              channels_last: bool = True, kernel: bool | None = None) -> torch.Tensor:
    """``(images - mean) * inv_std`` per channel, as ``dtype``, shaped ``[N, 3, H, W]``.

    Args:
        images: uint8 ``[N, H, W, 3]``, contiguous.
        mean: fp32 ``[3]``, on ``images``' device, on the 0-255 scale.
        inv_std: fp32 ``[3]``: 1 / the standard deviation, on the 0-255 scale.
        dtype: the output's floating dtype.
        channels_last: the output's memory is NHWC behind its NCHW shape (what
            convolutions prefer); otherwise contiguous NCHW.
        kernel: use the one-pass kernel (None: on CUDA, where Triton runs).

    Returns:
        A new tensor on ``images``' device.
    """
    if kernel is None:
        kernel = images.is_cuda and not _kernel_failed
    if kernel and images.is_contiguous():
        try:
            return _normalize_in_one_pass(images, mean, inv_std, dtype, channels_last)
        except Exception as e:  # noqa: BLE001 - no compiler, an old driver: torch's ops instead
            _give_up_kernel(e)
    return normalize_with_torch(images, mean, inv_std, dtype, channels_last)


def normalize_with_torch(images: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, dtype: torch.dtype,
                         channels_last: bool = True) -> torch.Tensor:
    """:func:`normalize` in torch's ops (several passes)."""
    nchw = images.permute(0, 3, 1, 2)  # NCHW shape over NHWC memory = channels_last
    out = nchw.float()  # keeps the memory format; fp32 for the arithmetic
    out.sub_(mean.view(1, 3, 1, 1)).mul_(inv_std.view(1, 3, 1, 1))
    out = out.to(dtype)
    return out if channels_last else out.contiguous()


def _give_up_kernel(error: Exception) -> None:
    global _kernel_failed
    _kernel_failed = f"{type(error).__name__}: {(str(error).strip().splitlines() or [''])[0]}"
    _log.warning("images are normalised with torch's ops (several passes): the one-pass kernel cannot run "
                 "here (%s)", _kernel_failed)


def _normalize_in_one_pass(images: torch.Tensor, mean: torch.Tensor, inv_std: torch.Tensor, dtype: torch.dtype,
                           channels_last: bool) -> torch.Tensor:
    n, h, w, c = images.shape
    if c != 3:
        raise ValueError(f"images of {c} channels, expected 3")
    memory_format = torch.channels_last if channels_last else torch.contiguous_format
    out = torch.empty((n, 3, h, w), dtype=dtype, device=images.device, memory_format=memory_format)
    total = images.numel()
    if total:
        grid = ((total + _BLOCK - 1) // _BLOCK,)
        _one_pass_kernel()[grid](images, out, mean, inv_std, total, h * w, channels_last, BLOCK=_BLOCK)
    return out


def _one_pass_kernel() -> Any:
    """The Triton kernel (compiled per dtype and layout on first use)."""
    global _kernel
    if _kernel is not None:
        return _kernel
    import triton
    import triton.language as tl

    @triton.jit
    def normalize_kernel(src, dst, mean, inv_std, total, plane, channels_last: tl.constexpr,
                         BLOCK: tl.constexpr):  # noqa: N803 - Triton's constexpr convention
        at = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        inside = at < total
        channel = at % 3
        value = tl.load(src + at, mask=inside, other=0).to(tl.float32)
        value = (value - tl.load(mean + channel, mask=inside, other=0.0)) * \
            tl.load(inv_std + channel, mask=inside, other=1.0)
        if channels_last:
            where = at  # NHWC memory: the same order as the source
        else:
            pixel = at // 3
            image = pixel // plane
            where = (image * 3 + channel) * plane + pixel % plane
        tl.store(dst + where, value.to(dst.dtype.element_ty), mask=inside)

    _kernel = normalize_kernel
    return _kernel
