"""``feeder train``: its options are TrainConfig's fields."""

from __future__ import annotations

import subprocess
import sys

import pytest

from core.errors import ConfigError
from tests.common.env import ROOT, child_env
from tests.common.options import assert_options_follow
from trainer.config import TrainConfig


def test_options_are_the_train_config_fields() -> None:
    assert_options_follow("train", TrainConfig)


def test_the_daemon_is_the_one_feeder_run_exported_when_no_server_is_given(monkeypatch) -> None:
    monkeypatch.setenv("FEEDER_ADDRESS", "unix:/run/feeder/feeder.sock")
    assert TrainConfig(dataset="sample").server == "unix:/run/feeder/feeder.sock"
    assert TrainConfig(server="127.0.0.1:5", dataset="sample").server == "127.0.0.1:5"  # given wins
    assert TrainConfig(dataset="sample", data="synthetic").server == ""  # synthetic data needs none
    monkeypatch.delenv("FEEDER_ADDRESS")
    with pytest.raises(ConfigError, match=r"^--server HOST:PORT \(or FEEDER_ADDRESS, which feeder run sets\)"):
        TrainConfig(dataset="sample")


def test_two_runs_of_one_dataset_and_seed_are_two_jobs_to_the_daemon(monkeypatch) -> None:
    from trainer.data import job_id

    config = TrainConfig(server="127.0.0.1:5", dataset="imagenet", seed=3)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4711")  # torchrun's --rdzv-id (the Slurm job id, say)
    first = job_id(config)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "4712")
    assert first == "train-imagenet-3-4711" and job_id(config) == "train-imagenet-3-4712"
    monkeypatch.delenv("TORCHELASTIC_RUN_ID")
    assert job_id(config) == "train-imagenet-3"


def test_without_the_trainers_extra_the_command_says_so_in_one_line_before_it_starts(tmp_path) -> None:
    # torchvision made unimportable, as in an install of the loader alone.
    script = ("import sys; sys.modules['torchvision'] = None; sys.argv[0] = 'feeder';"
              "from cli.app import main; main()")
    run = subprocess.run([sys.executable, "-c", script, "train", "--data", "synthetic", "--device", "cpu",
                          "--out-dir", str(tmp_path)], cwd=ROOT, env=child_env(), capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 1
    assert run.stderr.splitlines() == ["feeder: error: the trainer needs torchvision: pip install 'feeder[trainer]'"]
    assert list(tmp_path.iterdir()) == []
