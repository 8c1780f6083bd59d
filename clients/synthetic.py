"""``SyntheticLoader``: random tensors made on the device, shaped like a
``FeederLoader``'s batches. The trainer's upper bound: images/s with the feeder
divided by images/s with this is the share of speed the input pipeline costs."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from clients.elastic import resume
from clients.position import Position, Positioned
from core.errors import ConfigError

__all__ = ["SyntheticLoader"]


class SyntheticLoader(Positioned):
    """Same iteration, sizes and state protocol as ``FeederLoader``; no data source.

    One random batch per (batch size, image size) is made on ``device`` and yielded
    again and again, so producing it costs nothing.

    Args:
        num_samples: Samples in the (pretend) split.
        num_classes: Labels are drawn from ``0..num_classes-1``.
        batch_size: Samples per batch, per rank.
        image_size: Image side in pixels.
        world_size: Ranks sharing the split.
        rank: This rank (for its saved state).
        device: Where the tensors are made.
        channels_last: NHWC memory layout behind the NCHW shape.
        dtype: Image dtype.
        seed: Seed of the random tensors.
    """

    def __init__(
        self,
        num_samples: int,
        num_classes: int,
        batch_size: int,
        image_size: int,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        channels_last: bool = True,
        dtype: torch.dtype = torch.float32,
        seed: int = 0,
        rank: int = 0,
    ) -> None:
        if num_samples < 1 or num_classes < 1 or world_size < 1:
            raise ConfigError("num_samples, num_classes and world_size must be >= 1")
        self.num_samples, self.num_classes, self.world_size, self.rank = num_samples, num_classes, world_size, rank
        self.device, self.dtype, self.channels_last, self.seed = (
            torch.device(device), dtype, channels_last, seed)
        self.batch_size, self.image_size = batch_size, image_size
        self.samples_per_rank = num_samples // world_size
        self.wait_seconds = 0.0
        self.stall_fraction = 0.0
        self.longest_wait_s = 0.0
        self.reconnects = 0
        self.position = Position()
        self._cache: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch`` (no-op if already in it)."""
        self.position.move_to_epoch(epoch)

    def set_batch_size(self, batch_size: int) -> None:
        """Batch size from the next batch on."""
        self.batch_size = batch_size

    def set_image_size(self, image_size: int) -> None:
        """Image side from the next batch on."""
        self.image_size = image_size

    def set_min_scale(self, min_scale: float) -> None:
        """Accepted for interface parity; random tensors have no crops."""

    def plan_sizes(self, epoch: int, batch_size: int, image_size: int, min_scale: float = 0.0) -> None:
        """Accepted for interface parity; nothing is prepared ahead."""

    def __len__(self) -> int:
        return max(self.samples_per_rank - self.position.cursor, 0) // self.batch_size

    @property
    def epoch_done(self) -> bool:
        """The current epoch's batches are all handed out."""
        return len(self) == 0

    @property
    def epoch_progress(self) -> float:
        """Share of the current epoch consumed."""
        return min(self.position.cursor / self.samples_per_rank, 1.0)

    def state_dict(self) -> dict[str, Any]:
        """Epoch and sample cursor, this rank and the world (as FeederLoader's, so the
        trainer merges them the same way: :func:`clients.merge_states`)."""
        return self.position.state_dict() | {"rank": self.rank, "world_size": self.world_size, "consumed": []}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state``: one rank's, or the job's at any world size (random
        tensors: after a resize the epoch simply starts over)."""
        at = resume(state, self.rank, self.world_size)
        self.position.load_state_dict({"epoch": at.epoch, "cursor": at.cursor})

    def _batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        key = (self.batch_size, self.image_size)
        if key not in self._cache:
            generator = torch.Generator(device=self.device).manual_seed(self.seed)
            shape = (self.batch_size, 3, self.image_size, self.image_size)
            images = torch.randn(shape, generator=generator, device=self.device).to(self.dtype)
            if self.channels_last:
                images = images.contiguous(memory_format=torch.channels_last)
            labels = torch.randint(0, self.num_classes, (self.batch_size,),
                                   generator=generator, device=self.device)
            self._cache = {key: (images, labels)}
        return self._cache[key]

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        while len(self) > 0:
            self.position.cursor += self.batch_size
            yield self._batch()
        self.position.next_epoch()

    def close(self) -> None:
        """Nothing to release."""

