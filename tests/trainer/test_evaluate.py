"""Validation: every pass the same figures over the whole split, the passes after the
first read from the stream opened ahead while the model trained."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from clients import FeederLoader
from feeder.server import FeederServer
from tests.common.sample_daemon import CLASSES, N_VAL, start_daemon
from trainer.evaluate import evaluate


@pytest.fixture
def served(shards: Path) -> Iterator[tuple[FeederServer, str]]:
    server, port = start_daemon(shards)
    yield server, f"127.0.0.1:{port}"
    server.stop(0).wait(10)


def _val_loader(address: str, image_size: int) -> FeederLoader:
    """The validation loader as the trainer makes it (trainer.data.make_loaders)."""
    return FeederLoader("sample", address=address, split="val", batch_size=8, image_size=image_size,
                        last_batch="pad", return_padding=True, augment="val", rank=0, world_size=1)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, CLASSES))


def test_passes_at_one_size_give_one_figure_from_one_stream(served: tuple[FeederServer, str]) -> None:
    server, address = served
    model = _model()
    with _val_loader(address, 32) as loader:
        passes = [evaluate(model, loader, image_size=32, batch_size=8) for _ in range(3)]
        opened = server.metrics.stats().streams_opened

    assert passes[0].images == N_VAL
    assert passes[1:] == passes[:1] * 2
    assert opened == 1, "the second and third passes came from the stream the first one opened"


def test_a_pass_at_another_size_opens_its_own_stream_and_sees_the_whole_split(
        served: tuple[FeederServer, str]) -> None:
    server, address = served
    model = _model()
    with _val_loader(address, 32) as loader:
        first = evaluate(model, loader, image_size=32, batch_size=8)
        bigger = evaluate(model, loader, image_size=48, batch_size=4)
        again = evaluate(model, loader, image_size=48, batch_size=4)
        opened = server.metrics.stats().streams_opened

    assert first.images == bigger.images == N_VAL
    assert again == bigger
    assert opened == 2
