"""The bundled trainer: a torchvision ResNet under torch DDP, fed by ``FeederLoader``
(``python -m trainer.train``, ``torchrun ... -m trainer.train``, ``feeder train``),
with phase schedules of image size, batch size, lr and momentum, AMP, top-1/top-5
validation, a time-to-accuracy log and mid-epoch checkpoints. It sits a layer above
``clients`` and uses only the loader's API; the loader installs without it (the
trainer's extra, ``pip install 'feeder[trainer]'``, brings torchvision and matplotlib).

Names are imported on first use, so ``feeder --help`` does not pay for importing torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from core.lazy import lazy_names

if TYPE_CHECKING:
    from trainer.config import TrainConfig
    from trainer.loop import train
    from trainer.schedule import Phase, Schedule, load_schedule

__all__ = ["Phase", "Schedule", "TrainConfig", "load_schedule", "train"]

_HOMES = {
    "Phase": "trainer.schedule",
    "Schedule": "trainer.schedule",
    "TrainConfig": "trainer.config",
    "load_schedule": "trainer.schedule",
    "train": "trainer.loop",
}


__getattr__ = lazy_names(__name__, _HOMES, globals())
