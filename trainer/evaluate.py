"""Validation: top-1 / top-5 over the whole split, every image once across ranks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from clients import FeederLoader
from trainer.accuracy import topk_correct
from trainer.distributed import all_reduce_sum

__all__ = ["Evaluation", "evaluate"]


@dataclass(frozen=True)
class Evaluation:
    """Validation figures, summed over all ranks.

    Attributes:
        top1: Fraction of images whose label is the top prediction.
        top5: Fraction whose label is among the top five.
        loss: Mean cross-entropy (no smoothing).
        images: Images counted (padding excluded): the split's size when all is well.
    """

    top1: float
    top5: float
    loss: float
    images: int


def evaluate(
    model: torch.nn.Module,
    loader: FeederLoader,
    image_size: int,
    batch_size: int,
    autocast: contextlib.AbstractContextManager | None = None,
) -> Evaluation:
    """Runs the whole validation split through ``model`` (collective: all ranks call it).

    Args:
        model: The model (put in eval mode here, back to train mode after).
        loader: A ``last_batch="pad"``, ``return_padding=True`` loader.
        image_size: Validation image side in pixels.
        batch_size: Validation batch size per rank.
        autocast: Mixed-precision context for the forward pass.

    Returns:
        The figures over every image of the split.
    """
    # Every pass is the same (the validation transform, no shuffle): the loader's next
    # epoch is this pass, streaming since the last one ended unless the sizes changed.
    loader.set_image_size(image_size)
    loader.set_batch_size(batch_size)
    model.eval()
    sums = torch.zeros(4, dtype=torch.float64, device=loader.device)
    with torch.no_grad():
        for images, labels, padding in loader:
            with autocast or contextlib.nullcontext():
                logits = model(images)
            sums[:3] += topk_correct(logits, labels, padding)
            losses = F.cross_entropy(logits.float(), labels, reduction="none")
            sums[3] += losses.masked_fill(padding, 0.0).sum()
    model.train()
    top1, top5, count, loss = all_reduce_sum(sums.tolist(), loader.device)
    denominator = max(count, 1.0)
    return Evaluation(top1 / denominator, top5 / denominator, loss / denominator, int(count))
