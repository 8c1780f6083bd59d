"""``FeederLoader`` where users already train, run for real on CPU ranks (gloo): a
training script written for ``DataLoader`` with only its ``DataLoader(...)``
statements changed, a plain Lightning module under DDP (every epoch full, every
validation image once, a fit killed mid-epoch resumed from its checkpoint on the next
sample), and Hugging Face Accelerate's ``prepare``. The frameworks are the
``frameworks`` extra, which ``make test`` installs."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.common.env import ROOT, child_env
from tests.common.sample_daemon import CLASSES, N_TRAIN, N_VAL, TRAIN_PER_CLASS, VAL_PER_CLASS
from tests.common.shards import build_sample_tree

pytestmark = pytest.mark.slow

_SCRIPTS = Path(__file__).parent / "frameworks"
_STRIDES = "Grad strides do not match bucket view strides"


def _needs(module: str) -> None:
    if importlib.util.find_spec(module) is None:
        pytest.skip(f"{module} is not installed (pip install -e '.[frameworks]'; make test installs it)")


def _run(command: list[str], daemon: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(command, env=child_env(FEEDER_ADDRESS=daemon, OMP_NUM_THREADS="1"), cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
    return done


def _torchrun(script: Path, *args: str, ranks: int = 2) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks),
            str(script), *args]


# -- a script written for DataLoader ------------------------------------------------
@pytest.fixture(scope="module")
def image_folders(shards, tmp_path_factory) -> Path:
    """The sample images as the script's ImageFolders want them (val in class folders)."""
    source = build_sample_tree(shards.parent, classes=CLASSES, train_per_class=TRAIN_PER_CLASS,
                               val_per_class=VAL_PER_CLASS)
    data = tmp_path_factory.mktemp("folders")
    (data / "train").symlink_to(source / "train")
    with (source / "LOC_val_solution.csv").open() as rows:
        for row in csv.DictReader(rows):
            folder = data / "val" / row["PredictionString"].split()[0]
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"{row['ImageId']}.JPEG").symlink_to(source / "val" / f"{row['ImageId']}.JPEG")
    return data


def _fed_by_feeder(script: str) -> str:
    """The script with its two ``DataLoader(...)`` statements made ``FeederLoader(...)``
    ones: the dataset argument becomes the served name (and split); nothing else."""
    for dataset, served in (("train_dataset", '"sample", image_size=args.image_size'),
                            ("val_dataset", '"sample", split="val", image_size=args.image_size')):
        statement = f"torch.utils.data.DataLoader(\n        {dataset},"
        assert script.count(statement) == 1
        script = script.replace(statement, f"FeederLoader(\n        {served},")
    return script.replace("from torch.utils.data import Subset\n",
                          "from torch.utils.data import Subset\n\nfrom clients import FeederLoader\n")


def _epochs(output: str, epochs: int, ranks: int) -> None:
    """Each epoch trained its full batch count on every rank and evaluated every
    validation image once across ranks, with finite losses."""
    for epoch in range(epochs):
        for rank in range(ranks):
            trained = re.search(rf"rank {rank} epoch {epoch} train batches (\d+) of (\d+) images (\d+) "
                                rf"loss ([0-9.e+-]+|nan|inf)", output)
            assert trained, output
            assert trained[1] == trained[2] and int(trained[3]) == N_TRAIN // ranks // 8 * 8
            assert math.isfinite(float(trained[4]))
        evaluated = re.search(rf"rank 0 epoch {epoch} \* Acc@1 \S+ images (\d+) loss ([0-9.e+-]+|nan|inf)", output)
        assert evaluated and int(evaluated[1]) == N_VAL and math.isfinite(float(evaluated[2])), output


def test_a_dataloader_script_runs_with_only_its_dataloader_statements_changed(daemon, image_folders, tmp_path):
    script = (_SCRIPTS / "dataloader_imagenet.py").read_text()
    as_written = _run([sys.executable, str(_SCRIPTS / "dataloader_imagenet.py"), str(image_folders)], daemon)
    _epochs(as_written.stdout, epochs=2, ranks=1)  # it is a DataLoader script: it runs as it is
    fed = tmp_path / "fed_by_feeder.py"
    fed.write_text(_fed_by_feeder(script))
    alone = _run([sys.executable, str(fed), str(image_folders)], daemon)
    _epochs(alone.stdout, epochs=2, ranks=1)
    under_ddp = _run(_torchrun(fed, str(image_folders)), daemon)
    _epochs(under_ddp.stdout, epochs=2, ranks=2)
    assert _STRIDES not in under_ddp.stderr  # the loader's default layout is the model's
    warned = [line for line in (alone.stderr + under_ddp.stderr).splitlines() if "IgnoredArgumentWarning" in line]
    assert warned and all("num_workers" in line or "pin_memory" in line or "sampler" in line for line in warned)


# -- Lightning ----------------------------------------------------------------------
def _lines(folder: Path, rank: int) -> list[dict]:
    return [json.loads(line) for line in (folder / f"rank-{rank}.jsonl").read_text().splitlines()]


def _keys(lines: list[dict], stage: str, epoch: int, before_step: int | None = None) -> list[str]:
    return [key for line in lines if line["stage"] == stage and line["epoch"] == epoch
            and (before_step is None or line["step"] < before_step) for key in line["keys"]]


def test_lightning_trains_every_epoch_and_validates_every_image_once(daemon, tmp_path):
    _needs("lightning")
    _run([sys.executable, str(_SCRIPTS / "lightning_fit.py"), str(tmp_path)], daemon)
    ranks = [_lines(tmp_path, rank) for rank in range(2)]
    for epoch in range(3):
        trained = [key for lines in ranks for key in _keys(lines, "train", epoch)]
        assert Counter(trained) == Counter({key: 1 for key in trained}) and len(trained) == N_TRAIN
        for lines in ranks:  # len(loader) batches each: 128 samples, 2 ranks, batches of 8
            assert sum(line["stage"] == "train" and line["epoch"] == epoch for line in lines) == N_TRAIN // 16
        validated = [key for lines in ranks for key in _keys(lines, "val", epoch)]
        assert Counter(validated) == Counter({key: 1 for key in validated}) and len(validated) == N_VAL


def test_a_lightning_fit_killed_mid_epoch_resumes_from_its_checkpoint_on_the_next_sample(daemon, tmp_path):
    _needs("lightning")
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    for folder in (killed, resumed):
        folder.mkdir()
    crash = subprocess.run([sys.executable, str(_SCRIPTS / "lightning_fit.py"), str(killed), "--kill-at-step", "13"],
                           env=child_env(FEEDER_ADDRESS=daemon, OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert crash.returncode == 17, crash.stderr[-3000:]
    checkpoint = killed / "checkpoints" / "epoch=1-step=11.ckpt"  # after step 11: 3 batches into epoch 1
    assert checkpoint.is_file() and max(line["step"] for line in _lines(killed, 0)) == 12  # trained past it
    _run([sys.executable, str(_SCRIPTS / "lightning_fit.py"), str(resumed), "--resume", str(checkpoint)], daemon)
    epoch_1 = [key for rank in range(2) for key in
               _keys(_lines(killed, rank), "train", 1, before_step=11) + _keys(_lines(resumed, rank), "train", 1)]
    assert Counter(epoch_1) == Counter({key: 1 for key in epoch_1}) and len(epoch_1) == N_TRAIN
    epoch_2 = [key for rank in range(2) for key in _keys(_lines(resumed, rank), "train", 2)]
    assert len(epoch_2) == len(set(epoch_2)) == N_TRAIN


# -- Accelerate ---------------------------------------------------------------------
def test_accelerate_prepare_hands_the_loader_back_and_every_rank_trains_its_part(daemon, tmp_path):
    _needs("accelerate")
    _run(_torchrun(_SCRIPTS / "accelerate_train.py", str(tmp_path)), daemon)
    records = [json.loads((tmp_path / f"rank-{rank}.json").read_text()) for rank in range(2)]
    for record in records:
        assert record["same_loader"] and record["world"] == 2
        assert all(math.isfinite(loss) for loss in record["losses"])
        assert len(record["losses"]) == 2 * record["batches"] == 2 * N_TRAIN // 16
    for epoch in ("0", "1"):
        keys = [key for record in records for key in record["seen"][epoch]]
        assert len(keys) == len(set(keys)) == N_TRAIN
