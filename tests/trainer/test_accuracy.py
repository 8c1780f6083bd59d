"""Accuracy counting with padding excluded, CSV log and plot."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch

from trainer.accuracy import EpochPart, EpochRecord, MetricsLog, plot_records, topk_correct


def test_topk_counts_and_excludes_padding() -> None:
    logits = torch.tensor([[9.0, 1, 0, 0, 0, 0], [0, 9, 8, 7, 6, 5], [1, 2, 3, 4, 5, 6],
                           [9, 8, 0, 0, 0, 0]])
    labels = torch.tensor([0, 2, 0, 1])
    assert topk_correct(logits, labels).tolist() == [1, 3, 4]  # row 3: label 0 ranks last of 6
    padding = torch.tensor([False, False, False, True])
    assert topk_correct(logits, labels, padding).tolist() == [1, 2, 3]


def test_topk_with_fewer_classes_than_k() -> None:
    logits = torch.tensor([[0.0, 1.0], [1.0, 0.0]])
    assert topk_correct(logits, torch.tensor([1, 1])).tolist() == [1, 2, 2]


def _record(epoch: int, top1: float) -> EpochRecord:
    return EpochRecord(epoch=epoch, phase=0, image_size=32, batch_size=8, lr=0.1, momentum=0.9,
                       train_loss=1.0, train_images=64, train_s=2.0, images_per_s=32.0,
                       stall_fraction=0.1, val_top1=top1, val_top5=1.0, val_images=16,
                       wall_s=3.0 * (epoch + 1))


def test_log_writes_csv_and_plot(tmp_path: Path) -> None:
    log = MetricsLog(tmp_path / "m.csv")
    log.append(_record(0, 0.25))
    log.append(_record(1, 0.5))
    rows = list(csv.DictReader((tmp_path / "m.csv").open()))
    assert [float(r["val_top1"]) for r in rows] == [0.25, 0.5]
    assert "img/s" in log.records[1].line() and "stall 10.0%" in log.records[1].line()
    assert plot_records(log.records, tmp_path / "m.png").stat().st_size > 1000
    silent = MetricsLog(tmp_path / "other.csv", write=False)
    silent.append(_record(0, 0.1))
    assert not (tmp_path / "other.csv").exists()


def test_an_epochs_parts_add_up_to_the_figures_of_the_whole() -> None:
    before = EpochPart(2, loss_sum=30.0, images=20, train_s=2.0, stall_s=0.2, idle_s=0.1, longest_wait_s=0.5)
    after = EpochPart(2, loss_sum=10.0, images=20, train_s=2.0, stall_s=0.6, idle_s=0.3, longest_wait_s=0.1)

    assert (before + after).figures == {"train_loss": 1.0, "train_images": 40, "train_s": 4.0, "images_per_s": 10.0,
                                        "stall_fraction": 0.2, "idle_fraction": 0.1, "longest_wait_s": 0.5}
    assert (before + EpochPart(2)).figures == before.figures  # resumed with no step left: the part before alone
    assert EpochPart(2).figures["images_per_s"] == 0.0
    with pytest.raises(ValueError, match="epoch 2's part cannot be followed by epoch 3's"):
        before + EpochPart(3)
