"""Schedules: bundled files parse, phases and lr follow the file, bad files say where."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError
from trainer.schedule import Phase, Schedule, bundled_schedules, load_schedule

TWO_PHASES = """
warmup_epochs = 1.0
lr_reference_batch = 256
[[phases]]
epochs = 2
image_size = 128
batch_size = 64
lr_start = 0.4
lr_end = 0.2
[[phases]]
epochs = 1
image_size = 224
batch_size = 32
lr_start = 0.1
lr_end = 0.0
momentum = 0.8
val_image_size = 256
"""


def test_bundled_schedules_load() -> None:
    assert {"imagenet-fastai", "sample"} <= set(bundled_schedules())
    fastai = load_schedule("imagenet-fastai")
    sizes = [p.image_size for p in fastai.phases]
    assert sizes[0] == 128 and 224 in sizes and sizes[-1] == 288  # progressive resizing
    assert load_schedule("sample").total_epochs >= 2


def test_phases_and_lr_follow_the_file(tmp_path: Path) -> None:
    path = tmp_path / "s.toml"
    path.write_text(TWO_PHASES)
    schedule = load_schedule(str(path))
    assert schedule.total_epochs == 3
    assert [schedule.phase_index(e) for e in range(4)] == [0, 0, 1, 1]
    assert schedule.phase_at(2).eval_image_size == 256 and schedule.phase_at(0).eval_image_size == 128
    # world 2 x batch 64 = 128 = half the reference batch: lr halves
    assert schedule.lr_at(0.5, world_size=2) == pytest.approx(0.5 * 0.35 * 0.5)  # warm-up half way
    assert schedule.lr_at(1.0, world_size=2) == pytest.approx(0.3 * 0.5)
    assert schedule.lr_at(2.5, world_size=4) == pytest.approx(0.05 * 32 * 4 / 256)


def test_bad_schedules_name_the_problem(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[[phases]]\nepochs = 0\nimage_size = 1\nbatch_size = 1\nlr_start = 1\nlr_end = 1\n")
    with pytest.raises(ConfigError, match=r"bad.toml: phase 0: .*epochs"):
        load_schedule(str(path))
    path.write_text("[[phases]]\nepochs = 1\nimage_size = 1\nbatch_size = 1\nlr_start = 1\n"
                    "lr_end = 1\nsize = 3\n")
    with pytest.raises(ConfigError, match="unknown keys"):
        load_schedule(str(path))
    path.write_text("phases = [")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_schedule(str(path))
    with pytest.raises(ConfigError, match="neither a file"):
        load_schedule("no-such-schedule")
    with pytest.raises(ConfigError, match="at least one phase"):
        Schedule(phases=())


def test_phase_checks_ranges() -> None:
    with pytest.raises(ConfigError, match="momentum"):
        Phase(epochs=1, image_size=8, batch_size=1, lr_start=0.1, lr_end=0.1, momentum=1.5)
