"""What a training script imports: ``FeederLoader`` (batches from a feeder daemon, on
the device, normalised, channels-last, resumable) and the pieces of the bundled
trainer (``python -m clients.train``)."""

from clients.loader import FeederLoader
from clients.schedule import Phase, Schedule, load_schedule
from clients.synthetic import SyntheticLoader
from clients.transfer import IMAGENET_MEAN, IMAGENET_STD

__all__ = [
    "FeederLoader",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "Phase",
    "Schedule",
    "SyntheticLoader",
    "load_schedule",
]
