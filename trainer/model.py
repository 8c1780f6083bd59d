"""The model and optimiser of the recipe: a torchvision ResNet with zero-initialised
residual BN, channels-last, SGD with Nesterov momentum and no weight decay on BN
parameters or biases."""

from __future__ import annotations

import torch
import torchvision

from core.errors import ConfigError
from trainer.config import ARCHS

__all__ = ["build_model", "build_optimizer", "param_groups"]

def build_model(arch: str, num_classes: int, device: torch.device) -> torch.nn.Module:
    """A torchvision ResNet, last BN gamma of each block zeroed, channels-last.

    Zeroing the last BN gamma makes every residual block start as the identity, which
    lets large-batch training start with a high learning rate (Goyal et al.).

    Raises:
        ConfigError: ``arch`` is not one of ``ARCHS``.
    """
    if arch not in ARCHS:
        raise ConfigError(f"--arch {arch!r}: choose one of {', '.join(ARCHS)}")
    model = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes,
                                              zero_init_residual=True)
    return model.to(device, memory_format=torch.channels_last)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two groups: weights with ``weight_decay``, BN parameters and biases without."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for param in model.parameters():
        if not param.requires_grad:
            continue
        # 1-d tensors are BN gammas/betas and biases
        (no_decay if param.ndim <= 1 else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


def build_optimizer(model: torch.nn.Module, weight_decay: float) -> torch.optim.SGD:
    """SGD with Nesterov momentum; lr and momentum are set per step by the trainer."""
    return torch.optim.SGD(param_groups(model, weight_decay), lr=0.0, momentum=0.9,
                           nesterov=True)
