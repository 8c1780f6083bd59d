"""Checkpoints: save then load gives back model, loader position and RNG streams."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from core.errors import NotFound
from trainer.checkpoint import (
    capture_rng,
    latest_checkpoint,
    load_checkpoint,
    restore_rng,
    save_checkpoint,
)
from trainer.distributed import Dist

ALONE = Dist(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"))


def test_save_then_load_restores_state_and_rng(tmp_path: Path) -> None:
    model = torch.nn.Linear(3, 2)
    torch.manual_seed(5)
    rng = capture_rng()
    expected = torch.rand(4)
    for step in (2, 4, 6):
        save_checkpoint(tmp_path, step, {"model": model.state_dict(), "step": step},
                        {"loader": {"epoch": 1, "cursor": 8 * step}, "rng": rng}, ALONE)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-000006"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-000004", "step-000006"]
    torch.rand(10)  # move the generator on
    shared, (mine,) = load_checkpoint(tmp_path, ALONE)
    assert shared["step"] == 6 and mine["loader"] == {"epoch": 1, "cursor": 48}
    torch.testing.assert_close(shared["model"]["weight"], model.weight)
    restore_rng(mine["rng"])
    torch.testing.assert_close(torch.rand(4), expected)


def test_missing_checkpoints_are_reported(tmp_path: Path) -> None:
    with pytest.raises(NotFound, match="no checkpoint"):
        load_checkpoint(tmp_path, ALONE)
    save_checkpoint(tmp_path, 1, {}, {}, ALONE)



def test_at_another_world_size_each_rank_takes_over_the_saved_ranks_of_its_residue(tmp_path: Path) -> None:
    for rank in range(3):  # saved by 3 ranks
        save_checkpoint(tmp_path, 1, {"step": 1}, {"rank": rank},
                        Dist(rank=rank, world_size=3, local_rank=rank, device=torch.device("cpu")))
    taken = [[s["rank"] for s in load_checkpoint(tmp_path, Dist(r, 2, r, torch.device("cpu")))[1]] for r in range(2)]
    assert taken == [[0, 2], [1]]
    grown = [load_checkpoint(tmp_path, Dist(r, 5, r, torch.device("cpu")))[1] for r in range(5)]
    assert [len(states) for states in grown] == [1, 1, 1, 0, 0]


def test_steps_past_a_million_prune_the_oldest_by_number_not_by_name(tmp_path: Path) -> None:
    # Before: sorted(glob("step-*")) put step-1000000 before step-999999 and deleted it,
    # the newest, the one LATEST names.
    for step in (999_998, 999_999, 1_000_000):
        save_checkpoint(tmp_path, step, {"step": step}, {"rank": 0}, ALONE)
    assert latest_checkpoint(tmp_path) == tmp_path / "step-1000000"
    assert sorted(p.name for p in tmp_path.glob("step-*")) == ["step-1000000", "step-999999"]
    shared, _ = load_checkpoint(tmp_path, ALONE)
    assert shared["step"] == 1_000_000


def test_every_checkpoint_file_is_synced_before_latest_moves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real = os.fsync

    def recording(fd: int) -> None:
        synced.append(os.readlink(f"/proc/self/fd/{fd}"))
        real(fd)

    monkeypatch.setattr(os, "fsync", recording)
    save_checkpoint(tmp_path, 3, {"step": 3}, {"rank": 0}, ALONE)
    names = [Path(p).name for p in synced]
    assert "shared.tmp" in names and "rank-0.tmp" in names and "LATEST.tmp" in names
    assert max(names.index("shared.tmp"), names.index("rank-0.tmp")) < names.index("LATEST.tmp")
    assert str(tmp_path) in synced, "the directory entries too"
