"""Where a loader is in the data: the epoch the next batch comes from and the sample
cursor within this rank's part of it (never a batch number, so batch size and image
size may change between batches). Shared by every loader of the trainer so saving and
resuming works the same for all of them."""

from __future__ import annotations

from typing import Any

__all__ = ["Position", "Positioned"]


class Position:
    """An (epoch, cursor) pair with the state-dict protocol of resumable objects."""

    def __init__(self, epoch: int = 0, cursor: int = 0) -> None:
        self.epoch, self.cursor = epoch, cursor

    def move_to_epoch(self, epoch: int) -> bool:
        """Go to the start of ``epoch``; False (and no change, keeping a resumed
        cursor) if already in it."""
        if epoch == self.epoch:
            return False
        self.epoch, self.cursor = epoch, 0
        return True

    def next_epoch(self) -> None:
        """Go to the start of the following epoch."""
        self.epoch, self.cursor = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        """``{"epoch", "cursor"}``."""
        return {"epoch": self.epoch, "cursor": self.cursor}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a saved ``state_dict``."""
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


class Positioned:
    """Base of the trainer's loaders: where they are, read through ``position``."""

    position: Position

    @property
    def epoch(self) -> int:
        """The epoch of the current pass (after its last batch, until the next pass)."""
        return self.position.epoch

    @property
    def cursor(self) -> int:
        """Samples of this rank's part of the current epoch already yielded."""
        return self.position.cursor
