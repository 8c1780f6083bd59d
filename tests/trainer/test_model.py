"""Model and optimiser set-up of the recipe."""

from __future__ import annotations

import pytest
import torch

from core.errors import ConfigError
from trainer.model import build_model, build_optimizer, param_groups


def test_resnet_zero_init_residual_and_channels_last() -> None:
    model = build_model("resnet18", 7, torch.device("cpu"))
    assert model.fc.out_features == 7
    for block in (model.layer1[0], model.layer4[1]):
        assert torch.count_nonzero(block.bn2.weight) == 0
    assert model.conv1.weight.is_contiguous(memory_format=torch.channels_last)
    with pytest.raises(ConfigError, match="vgg"):
        build_model("vgg16", 7, torch.device("cpu"))


def test_no_weight_decay_on_bn_and_bias() -> None:
    model = build_model("resnet18", 3, torch.device("cpu"))
    decay, no_decay = param_groups(model, 1e-4)
    assert decay["weight_decay"] == 1e-4 and no_decay["weight_decay"] == 0.0
    no_decay_ids = {id(p) for p in no_decay["params"]}
    bn_and_bias = [model.bn1.weight, model.bn1.bias, model.fc.bias, model.layer2[0].bn1.weight]
    assert all(id(p) in no_decay_ids for p in bn_and_bias)
    assert id(model.fc.weight) not in no_decay_ids and id(model.conv1.weight) not in no_decay_ids
    total = sum(1 for _ in model.parameters())
    assert len(decay["params"]) + len(no_decay["params"]) == total
    optimizer = build_optimizer(model, 1e-4)
    assert optimizer.defaults["nesterov"] is True
