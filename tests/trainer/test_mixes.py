"""The trainer on a mix of datasets: ``--dataset NAME=WEIGHT,...`` parsed with one line
per bad entry, ``--val-dataset`` (default: the mix's first), and a run of two gloo
ranks under torchrun training on each dataset's share of every epoch."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from core.errors import ConfigError
from feeder.config import ServerConfig
from feeder.server import create_server
from tests.common.env import ROOT, child_env
from tests.common.mixes import build_extra_shards
from tests.trainer.conftest import run_trainer
from trainer.config import TrainConfig, parse_mix
from trainer.data import make_loaders
from trainer.distributed import Dist
from trainer.schedule import Phase

SCHEDULE = """
warmup_epochs = 0.0

[[phases]]
epochs = 1
image_size = 32
batch_size = 8
lr_start = 0.05
lr_end = 0.05
"""


def test_a_mix_is_names_and_weights_in_the_order_given() -> None:
    assert parse_mix("imagenet") == "imagenet"
    assert list(parse_mix("imagenet=0.8, extra=0.2").items()) == [("imagenet", 0.8), ("extra", 0.2)]
    config = TrainConfig(server="127.0.0.1:5", dataset="extra=1,imagenet=3")
    assert config.train_dataset == {"extra": 1.0, "imagenet": 3.0} and config.validation_dataset == "extra"
    assert TrainConfig(server="127.0.0.1:5", dataset="a=1,b=1", val_dataset="b").validation_dataset == "b"


@pytest.mark.parametrize("text,line", [
    ("a=0.5,a=0.5", "--dataset 'a=0.5,a=0.5': 'a' given twice"),
    ("a=0.5,b=0", "--dataset 'a=0.5,b=0': the weight of 'b' is '0', not a positive finite number"),
    ("a=-1,b=1", "--dataset 'a=-1,b=1': the weight of 'a' is '-1'"),
    ("a=nan,b=1", "--dataset 'a=nan,b=1': the weight of 'a' is 'nan'"),
    ("a=inf,b=1", "--dataset 'a=inf,b=1': the weight of 'a' is 'inf'"),
    ("a=x,b=1", "--dataset 'a=x,b=1': the weight of 'a' is 'x'"),
    ("a,b", "--dataset 'a,b': 'a' is not NAME=WEIGHT"),
])
def test_a_bad_mix_is_one_line_naming_the_entry(text: str, line: str) -> None:
    with pytest.raises(ConfigError) as caught:
        TrainConfig(server="127.0.0.1:5", dataset=text)
    assert str(caught.value).startswith(line)


@pytest.mark.slow
def test_the_command_refuses_a_name_given_twice_in_one_line(tmp_path: Path) -> None:
    run = subprocess.run([sys.executable, "-m", "feeder", "train", "--data", "synthetic", "--device", "cpu",
                          "--dataset", "a=1,a=2", "--out-dir", str(tmp_path)], cwd=ROOT, env=child_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert run.stderr.splitlines() == ["feeder: error: --dataset 'a=1,a=2': 'a' given twice"]


@pytest.fixture(scope="module")
def mixed_daemon(shards: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    extra = build_extra_shards(tmp_path_factory.mktemp("extra"))
    server, port = create_server(ServerConfig.of(datasets={"sample": shards, "extra": extra}, port=0, device="cpu",
                                                 threads=1, max_batch_size=64, grace_s=0.5))
    yield f"127.0.0.1:{port}"
    server.stop(0).wait(10)


@pytest.mark.slow
def test_validation_on_a_dataset_whose_labels_mean_other_classes_is_refused(mixed_daemon: str) -> None:
    config = TrainConfig(server=mixed_daemon, dataset="sample=0.75,extra=0.25", val_dataset="extra",
                         val_split="train")
    dist = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))
    with pytest.raises(ConfigError, match=r"^--val-dataset 'extra': its 3 classes are not the first of the 6"):
        make_loaders(config, dist, Phase(epochs=1, image_size=32, batch_size=8, lr_start=0.1, lr_end=0.1))


@pytest.mark.slow
def test_two_ranks_train_on_each_datasets_share_and_validate_on_the_first(mixed_daemon: str, tmp_path: Path) -> None:
    schedule = tmp_path / "one.toml"
    schedule.write_text(SCHEDULE)
    result = run_trainer(mixed_daemon, "--dataset", "sample=0.75,extra=0.25", "--arch", "resnet18",
                         "--schedule", str(schedule), "--out-dir", str(tmp_path), "--visit-log",
                         str(tmp_path / "visits"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    visits: Counter[str] = Counter()
    for path in sorted((tmp_path / "visits").glob("rank-*.json")):
        visits.update(json.loads(path.read_text()))
    # 152 samples an epoch, 76 a rank: 9 batches of 8 each (drop leaves 4 a rank out).
    by_dataset = Counter(key.split("/")[0] for key in visits.elements())
    assert sum(by_dataset.values()) == 144 and by_dataset["extra"] == 36  # a quarter of every batch of 8
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["val_images"] == 32  # the first dataset's val split, every image once
