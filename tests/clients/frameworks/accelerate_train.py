"""A Hugging Face Accelerate loop fed by ``FeederLoader``, as a user writes it: the
model, the optimizer and the loader go through ``accelerator.prepare``. Accelerate
wraps what it knows (the model in DDP, the optimizer) and hands back any other
iterable as it is, so the loader keeps its own rank split and device.

Each rank writes what it trained on (keys by epoch), the loss, and whether the loader
came back from ``prepare`` as itself to ``OUT/rank-R.json``.

Run under torchrun (CPU ranks, gloo) as ``python accelerate_train.py OUT`` with
``FEEDER_ADDRESS`` set.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator

from clients import FeederLoader

EPOCHS = 2


def main() -> None:
    out = Path(sys.argv[1])
    accelerator = Accelerator(cpu=True)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3, stride=2), torch.nn.ReLU(), torch.nn.AdaptiveAvgPool2d(1),
                                torch.nn.Flatten(), torch.nn.Linear(8, 4))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = FeederLoader("sample", batch_size=8, image_size=32, return_keys=True, device=accelerator.device)
    model, optimizer, prepared = accelerator.prepare(model, optimizer, loader)
    seen: dict[int, list[str]] = {}
    losses = []
    for epoch in range(EPOCHS):
        seen[epoch] = []
        for images, labels, keys in prepared:
            loss = F.cross_entropy(model(images), labels)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
            seen[epoch] += keys
    record = {"same_loader": prepared is loader, "batches": len(loader), "seen": seen, "losses": losses,
              "rank": accelerator.process_index, "world": accelerator.num_processes}
    (out / f"rank-{accelerator.process_index}.json").write_text(json.dumps(record))


if __name__ == "__main__":
    main()
