"""Mid-epoch checkpoints that survive a crash during writing.

Layout under the checkpoint directory::

    step-000120/shared.pt     model, optimizer, scaler, trainer state, the job's loader
                              state (rank 0 writes)
    step-000120/rank-0.pt     RNG and visit counts of rank 0 (each rank its own)
    LATEST                    name of the last complete step directory

``LATEST`` moves only after every rank has written its file, and every file (and the
directory entries naming them) reaches the disk before it does, so a crash or a power
loss while writing leaves the previous checkpoint in force. Old step directories are
pruned by step number (``step-1000000`` is newer than ``step-999999``), never the one
``LATEST`` names.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import torch

from core.errors import NotFound
from shards.layout import fsync_dir
from trainer.distributed import Dist, barrier

__all__ = ["capture_rng", "latest_checkpoint", "load_checkpoint", "restore_rng",
           "save_checkpoint"]

LATEST = "LATEST"
KEEP = 2  # step directories kept; older ones are removed


def capture_rng() -> dict[str, Any]:
    """Every random generator the trainer may touch."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate(),
             "numpy": np.random.get_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Puts the generators back as ``capture_rng`` found them."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _atomic_save(obj: Any, path: Path) -> None:
    """``obj`` at ``path`` whole or not at all, on the disk when this returns."""
    tmp = path.with_suffix(".tmp")
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _atomic_write_text(text: str, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _step_of(folder: Path) -> int:
    """The step a ``step-N`` directory is of (-1 for a name that is not one)."""
    digits = folder.name.removeprefix("step-")
    return int(digits) if digits.isdigit() else -1


def _prune(root: Path, keep: Path) -> None:
    """Remove all but the ``KEEP`` newest step directories, by step number, never ``keep``."""
    folders = sorted((f for f in root.glob("step-*") if f.is_dir() and _step_of(f) >= 0), key=_step_of)
    for old in folders[:-KEEP]:
        if old != keep:
            shutil.rmtree(old, ignore_errors=True)


def save_checkpoint(root: Path, step: int, shared: dict[str, Any], per_rank: dict[str, Any],
                    dist: Dist) -> Path:
    """Writes one checkpoint collectively (every rank must call it at the same step).

    Args:
        root: Checkpoint directory.
        step: Global optimizer step, names the step directory.
        shared: State equal on all ranks (model, optimizer...); rank 0 writes it.
        per_rank: This rank's own state (loader position, RNG).
        dist: This process's place in the job.

    Returns:
        The step directory.
    """
    folder = root / f"step-{step:06d}"
    folder.mkdir(parents=True, exist_ok=True)
    if dist.is_main:
        _atomic_save(shared, folder / "shared.pt")
    _atomic_save(per_rank, folder / f"rank-{dist.rank}.pt")
    barrier()
    if dist.is_main:
        fsync_dir(root)  # the step directory's own entry
        _atomic_write_text(folder.name, root / LATEST)
        _prune(root, folder)
    barrier()
    return folder


def latest_checkpoint(root: Path) -> Path | None:
    """The last complete step directory under ``root``, or None."""
    marker = root / LATEST
    if not marker.is_file():
        return None
    return root / marker.read_text().strip()


def load_checkpoint(root: Path, dist: Dist) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Reads the latest checkpoint: ``(shared, the states of the ranks this rank takes
    over)``. At the world size it was written at, that is this rank's own state; at
    another, rank ``r`` of ``w`` takes the saved ranks ``r, r + w, r + 2w, ...`` (none,
    for a rank the job did not have then), so that what they hold (their visit counts)
    is carried over once.

    Raises:
        NotFound: No complete checkpoint under ``root``.
    """
    folder = latest_checkpoint(root)
    if folder is None:
        raise NotFound(f"no checkpoint under {root} (no {LATEST} file)")
    saved = sorted(int(p.stem.removeprefix("rank-")) for p in folder.glob("rank-*.pt"))
    mine = [r for r in saved if r % dist.world_size == dist.rank]
    # weights_only=False: the files hold RNG states and plain dicts this trainer wrote
    shared = torch.load(folder / "shared.pt", map_location=dist.device, weights_only=False)
    states = [torch.load(folder / f"rank-{r}.pt", map_location="cpu", weights_only=False) for r in mine]
    return shared, states
