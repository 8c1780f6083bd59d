"""The trainer's loaders: from a daemon (with TLS and a token) or synthetic, sized by
the daemon's dataset."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from feeder.config import ServerConfig
from feeder.server import create_server
from tests.common.tls import make_certificates
from trainer.config import TrainConfig
from trainer.data import _describe_synthetic, make_loaders
from trainer.distributed import Dist
from trainer.schedule import Phase

TOKEN = "trainer-test-token"


@pytest.fixture(scope="module")
def tls_daemon(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[int, Path]]:
    """A daemon that speaks TLS and wants ``TOKEN``: its port and its CA's certificate."""
    tmp_path = tmp_path_factory.mktemp("tls-daemon")
    certs = make_certificates(tmp_path / "certs")
    (tmp_path / "token").write_text(TOKEN)
    server, port = create_server(ServerConfig.of(
        datasets={"sample": shards}, port=0, device="cpu", threads=1, max_batch_size=64, grace_s=0.5,
        token_file=tmp_path / "token", tls_cert=certs.server_cert, tls_key=certs.server_key))
    yield port, certs.ca
    server.stop(0).wait(10)


@pytest.mark.slow
@pytest.mark.parametrize("data", ["feeder", "synthetic"])
def test_the_trainers_loaders_use_tls_root_and_feeder_token(tls_daemon, monkeypatch, tmp_path, data):
    port, ca = tls_daemon
    monkeypatch.setenv("FEEDER_TOKEN", TOKEN)
    config = TrainConfig(server=f"127.0.0.1:{port}", tls_root=ca, dataset="sample", data=data, out_dir=tmp_path)
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    train, val, classes = make_loaders(config, dist, Phase(epochs=1, image_size=32, batch_size=8,
                                                           lr_start=0.1, lr_end=0.1))
    assert classes == 4
    if data == "feeder":
        with train, val:
            assert tuple(next(iter(train))[0].shape) == (8, 3, 32, 32)
            assert val is not None and len(val) > 0


def test_synthetic_data_takes_its_sizes_from_the_first_daemon_of_a_pool(daemon: str) -> None:
    config = TrainConfig(server=f"{daemon},127.0.0.1:1", dataset="sample", data="synthetic")

    samples, classes = _describe_synthetic(config)

    assert (samples, classes) == _describe_synthetic(TrainConfig(server=daemon, dataset="sample", data="synthetic"))
    assert classes < 1000
