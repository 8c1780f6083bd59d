"""The one-pass normalisation (:mod:`clients.normalize`): the Triton kernel, run by
Triton's interpreter on the CPU, gives what torch's ops give, in every dtype and both
layouts, for sizes that fill its blocks and sizes that do not (exactly, but for the
interpreter's own bf16 rounding; on a GPU exactly: the ``gpu`` test)."""

from __future__ import annotations

import builtins
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

import clients.normalize as normalize_module
from clients.normalize import normalize, normalize_with_torch
from clients.transfer import IMAGENET_MEAN, IMAGENET_STD, DeviceTransfer
from tests.common.env import ROOT, child_env

_KERNEL_ON_CPU = """
import torch
from clients.normalize import normalize, normalize_with_torch
mean = torch.tensor([123.7, 116.3, 103.5])
inv_std = 1 / torch.tensor([58.4, 57.1, 57.4])
torch.manual_seed(0)
checked = 0
for shape in [(2, 5, 7, 3), (1, 64, 48, 3), (3, 1, 1, 3)]:
    images = torch.randint(0, 256, shape, dtype=torch.uint8)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for channels_last in (True, False):
            out = normalize(images, mean, inv_std, dtype, channels_last, kernel=True)
            ref = normalize_with_torch(images, mean, inv_std, dtype, channels_last)
            assert out.shape == ref.shape == (shape[0], 3, shape[1], shape[2]), out.shape
            layout = torch.channels_last if channels_last else torch.contiguous_format
            assert out.dtype == dtype and out.is_contiguous(memory_format=layout)
            if dtype is torch.bfloat16:  # the interpreter rounds to bf16 its own way: 1 unit at most
                assert torch.allclose(out.float(), ref.float(), rtol=2**-7, atol=0), (shape, channels_last)
            else:
                assert torch.equal(out, ref), (shape, dtype, channels_last, (out.float() - ref.float()).abs().max())
            checked += 1
import clients.normalize
assert not clients.normalize._kernel_failed, clients.normalize._kernel_failed  # torch's ops would pass too
print("checked", checked)
"""


def test_the_kernel_gives_what_torchs_ops_give() -> None:
    pytest.importorskip("triton")
    env = child_env() | {"TRITON_INTERPRET": "1"}  # read when the kernel is compiled
    done = subprocess.run([sys.executable, "-c", _KERNEL_ON_CPU], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["checked", "18"]


@pytest.mark.parametrize("failure", ["no triton", "no compiler"])
def test_a_kernel_that_cannot_run_gives_way_to_torchs_ops(monkeypatch, failure) -> None:
    monkeypatch.setattr(normalize_module, "_kernel", None)
    monkeypatch.setattr(normalize_module, "_kernel_failed", "")
    if failure == "no triton":
        real_import = builtins.__import__

        def no_triton(name, *args, **kwargs):
            if name == "triton" or name.startswith("triton."):
                raise ModuleNotFoundError("No module named 'triton'")
            return real_import(name, *args, **kwargs)

        monkeypatch.setattr(builtins, "__import__", no_triton)
    else:  # Triton imports, and its first launch fails (its launcher is built with a C compiler)
        monkeypatch.setattr(normalize_module, "_one_pass_kernel", _Unlaunchable)
    images = torch.randint(0, 256, (2, 4, 5, 3), dtype=torch.uint8)
    mean, inv_std = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.25, 0.125])
    out = normalize(images, mean, inv_std, torch.float16, channels_last=False, kernel=True)
    assert torch.equal(out, normalize_with_torch(images, mean, inv_std, torch.float16, channels_last=False))
    assert out.is_contiguous()
    assert normalize_module._kernel_failed.startswith(("ModuleNotFoundError", "RuntimeError"))


class _Unlaunchable:
    """A kernel whose launch fails as Triton's first one does without a C compiler."""

    def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., None]:
        def launch(*args: object, **kwargs: object) -> None:
            raise RuntimeError("Failed to find C compiler. Please specify via CC environment variable.")
        return launch


def test_off_cuda_it_is_torchs_ops() -> None:
    images = torch.randint(0, 256, (2, 4, 4, 3), dtype=torch.uint8)
    mean, inv_std = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([0.5, 0.25, 0.125])
    out = normalize(images, mean, inv_std, torch.bfloat16)
    assert torch.equal(out, normalize_with_torch(images, mean, inv_std, torch.bfloat16))
    assert out.is_contiguous(memory_format=torch.channels_last)


def test_the_transfer_normalises_with_imagenets_statistics_into_the_dtype_asked_for() -> None:
    images = torch.randint(0, 256, (2, 6, 5, 3), dtype=torch.uint8)
    labels = torch.tensor([3, 4])
    out, moved = DeviceTransfer(torch.device("cpu"), dtype=torch.float16)(images, labels)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1) * 255
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1) * 255
    expected = (images.permute(0, 3, 1, 2).float() - mean) / std
    assert out.dtype == torch.float16 and out.shape == (2, 3, 6, 5)
    assert (out.float() - expected).abs().max() < 0.01 and torch.equal(moved, labels)
    raw, _ = DeviceTransfer(torch.device("cpu"), normalize=False, channels_last=False)(images, labels)
    assert raw.dtype == torch.uint8 and raw.is_contiguous() and torch.equal(raw, images.permute(0, 3, 1, 2))


@pytest.mark.gpu
def test_on_a_gpu_the_kernel_gives_exactly_what_torchs_ops_give(monkeypatch) -> None:
    # normalize() would answer with torch's ops where the kernel fails: this test fails instead, saying why.
    monkeypatch.setattr(normalize_module, "_kernel_failed", "")
    mean = torch.tensor([123.7, 116.3, 103.5], device="cuda")
    inv_std = 1 / torch.tensor([58.4, 57.1, 57.4], device="cuda")
    images = torch.randint(0, 256, (8, 224, 224, 3), dtype=torch.uint8, device="cuda")
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for channels_last in (True, False):
            out = normalize(images, mean, inv_std, dtype, channels_last, kernel=True)
            assert not normalize_module._kernel_failed, f"the kernel did not run: {normalize_module._kernel_failed}"
            layout = torch.channels_last if channels_last else torch.contiguous_format
            assert out.dtype == dtype and out.is_contiguous(memory_format=layout)
            assert torch.equal(out, normalize_with_torch(images, mean, inv_std, dtype, channels_last))
