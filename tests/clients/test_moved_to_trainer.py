"""Old names still work, each with one deprecation warning naming the new one: the
bundled trainer's under ``clients``, and ``clients.loader_config`` (now
``clients.config``)."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

import clients
import trainer
from tests.common.env import ROOT, child_env


@pytest.mark.parametrize("name", ["Phase", "Schedule", "load_schedule"])
def test_the_schedule_names_of_the_package_warn_and_are_the_trainers(name: str) -> None:
    with pytest.warns(DeprecationWarning, match=rf"^clients\.{name} is deprecated, use trainer\.{name}$"):
        old = getattr(clients, name)
    assert old is getattr(trainer, name)
    assert name not in clients.__all__


def test_from_clients_import_points_the_warning_at_the_importer() -> None:
    # ``from package import name`` looks the name up twice (importlib first asks whether it
    # is a submodule): the same warning at the same line, which Python's filters show once.
    with pytest.warns(DeprecationWarning) as caught:
        from clients import load_schedule  # noqa: F401
    assert {(Path(w.filename).name, w.lineno, str(w.message)) for w in caught} == {
        (Path(__file__).name, caught[0].lineno, "clients.load_schedule is deprecated, use trainer.load_schedule")}


@pytest.mark.parametrize("name", ["TrainConfig", "ARCHS", "IMAGENET_TRAIN_SAMPLES"])
def test_the_trainers_config_names_in_clients_config_warn_and_are_the_trainers(name: str) -> None:
    import clients.config
    import trainer.config

    message = rf"^clients\.config\.{name} is deprecated, use trainer\.config\.{name}$"
    with pytest.warns(DeprecationWarning, match=message):
        old = getattr(clients.config, name)
    assert old is getattr(trainer.config, name)


def test_from_clients_config_import_train_config_warns_once_at_the_importer() -> None:
    with pytest.warns(DeprecationWarning) as caught:
        from clients.config import TrainConfig  # noqa: F401
    assert [(Path(w.filename).name, str(w.message)) for w in caught] == [
        (Path(__file__).name, "clients.config.TrainConfig is deprecated, use trainer.config.TrainConfig")]


def test_clients_loader_config_warns_once_and_is_clients_config() -> None:
    import clients.config

    sys.modules.pop("clients.loader_config", None)
    message = r"^clients\.loader_config is deprecated, use clients\.config$"
    with pytest.warns(DeprecationWarning, match=message) as caught:
        old = importlib.import_module("clients.loader_config")
    assert len(caught) == 1
    assert old.LoaderConfig is clients.config.LoaderConfig and old.TRANSPORTS is clients.config.TRANSPORTS
    with pytest.raises(AttributeError):
        old.NoSuchName  # noqa: B018


@pytest.mark.slow  # a real (one-step) training run
def test_python_m_clients_train_warns_in_one_line_and_runs_the_trainer(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "clients.train", "--data", "synthetic", "--device", "cpu", "--arch", "resnet18",
               "--schedule", "sample", "--epochs", "1", "--max-steps-per-epoch", "1", "--synthetic-samples", "16",
               "--val-every-epochs", "0", "--log-every-steps", "0", "--out-dir", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, env=child_env(OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stderr.splitlines() == ["feeder: warning: python -m clients.train is deprecated, use python -m "
                                       "trainer.train"]
    assert (tmp_path / "summary.json").exists()


def test_python_m_clients_train_warns_once_per_job_not_once_per_rank() -> None:
    run = subprocess.run([sys.executable, "-m", "clients.train", "--help"], cwd=ROOT,
                         env=child_env(RANK="1"), capture_output=True, text=True, timeout=60)
    assert run.returncode == 0 and run.stderr == "" and "--schedule" in run.stdout
