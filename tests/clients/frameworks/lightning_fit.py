"""A plain Lightning module and data module fed by ``FeederLoader``, as a user writes
them: no hook of its own touches the loaders. Lightning runs it on CPU ranks under DDP
(it starts the other ranks itself, running this file again).

Each rank writes what it trained on and validated (keys by step) to ``OUT/rank-R.jsonl``.
``--kill-at-step N``: every rank exits at once after optimizer step N, as a crash would;
``--resume CKPT``: ``fit`` goes on from that checkpoint.

Run as ``python lightning_fit.py OUT [--kill-at-step N] [--resume CKPT]`` with
``FEEDER_ADDRESS`` set.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import ModelCheckpoint

from clients import FeederLoader

BATCH = 8
IMAGE = 32
CHECKPOINT_EVERY_STEPS = 11  # mid epoch 1 (8 steps an epoch on two ranks)


class Net(L.LightningModule):
    def __init__(self, out: Path, classes: int = 4) -> None:
        super().__init__()
        self.out = out
        self.body = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(),
                                        torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, classes))

    def _record(self, stage: str, keys: list[str]) -> None:
        line = {"stage": stage, "epoch": self.current_epoch, "step": self.global_step, "keys": list(keys)}
        with (self.out / f"rank-{self.global_rank}.jsonl").open("a") as log:
            log.write(json.dumps(line) + "\n")

    def training_step(self, batch, batch_idx):
        images, labels, keys = batch
        self._record("train", keys)
        loss = F.cross_entropy(self.body(images), labels)
        assert torch.isfinite(loss)
        return loss

    def validation_step(self, batch, batch_idx):
        images, labels, keys = batch
        self._record("sanity" if self.trainer.sanity_checking else "val", keys)
        loss = F.cross_entropy(self.body(images), labels)
        self.log("val_loss", loss, sync_dist=True, batch_size=len(labels))  # reduced once, at the epoch's end

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class Sample(L.LightningDataModule):
    def train_dataloader(self):
        return FeederLoader("sample", batch_size=BATCH, image_size=IMAGE, return_keys=True, shuffle=True)

    def val_dataloader(self):
        return FeederLoader("sample", split="val", batch_size=BATCH, image_size=IMAGE, return_keys=True)


class KillAt(L.Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step == self.step:
            os._exit(17)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("--kill-at-step", type=int, default=0)
    parser.add_argument("--resume", default=None)
    args = parser.parse_args()
    callbacks: list[L.Callback] = [ModelCheckpoint(dirpath=args.out / "checkpoints", save_top_k=-1,
                                                   every_n_train_steps=CHECKPOINT_EVERY_STEPS)]
    if args.kill_at_step:
        callbacks.append(KillAt(args.kill_at_step))
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy="ddp", max_epochs=3, logger=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(Net(args.out), datamodule=Sample(), ckpt_path=args.resume)


if __name__ == "__main__":
    main()
