"""What a runner takes and gives back: a :class:`Job` (one batch's encoded samples and
crop windows) in, an :class:`Outcome` out, in the order the jobs went in.

An outcome is :class:`Decoded` (the job and the slot its pixels were written into) or
:class:`Failed` (the job and a :class:`SampleDecodeError` naming the failing samples'
positions, with a reason each). A runner never decides what to do with a failure:
whoever feeds it applies its error policy (:mod:`feeder.producer`) and may run a
repaired job alone. The positions are data, found once: from the decoder's own
report, else by :func:`locate_failures`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar, Union

import numpy as np

from core.errors import DataError
from decode.augment import Crops
from transport.base import Slot

__all__ = [
    "Allocate",
    "Decoded",
    "Failed",
    "Job",
    "JobT",
    "Outcome",
    "SampleDecodeError",
    "locate_failures",
]


@dataclass(frozen=True)
class Job:
    """One run's inputs.

    Attributes:
        jpegs: encoded samples, one uint8 array each.
        image_size: output side in pixels.
        crops: each sample's window (in the pixels of its bytes) and flip.
        indices: the samples' positions in their split, for runners that look
            samples up by them (the decoded cache); None where there is no split.
    """

    jpegs: Sequence[np.ndarray]
    image_size: int
    crops: Crops
    indices: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.jpegs)

    def only(self, positions: Sequence[int]) -> Job:
        """The job of the samples at ``positions`` alone."""
        rows = list(positions)
        indices = None if self.indices is None else self.indices[rows]
        return Job([self.jpegs[p] for p in rows], self.image_size, self.crops.rows(rows), indices)


JobT = TypeVar("JobT", bound=Job)
# Supplies the slot a batch of the given shape is written into (a transport's, so the
# pixels are written where they leave; host or device memory).
Allocate = Callable[[tuple[int, ...]], Slot]


class SampleDecodeError(DataError):
    """A run failed because of some of its samples.

    Attributes:
        failures: position in the run -> why that sample did not decode; None where
            the decoder did not say which (:func:`locate_failures` finds them).
        detail: the decoder's reason for the run as a whole.
    """

    def __init__(self, detail: str, failures: dict[int, str] | None = None) -> None:
        named = f" (samples {sorted(failures)})" if failures else ""
        super().__init__(f"decode failed{named}: {detail}")
        self.detail = detail
        self.failures = failures

    @property
    def positions(self) -> tuple[int, ...]:
        """The failing positions, sorted (empty where not known)."""
        return tuple(sorted(self.failures or ()))


@dataclass(frozen=True)
class Decoded(Generic[JobT]):
    """A job that decoded: its pixels are in ``slot`` (uint8 ``[N, size, size, 3]``)."""

    job: JobT
    slot: Slot


@dataclass(frozen=True)
class Failed(Generic[JobT]):
    """A job that did not decode; ``error.failures`` is always set."""

    job: JobT
    error: SampleDecodeError


Outcome = Union[Decoded[JobT], Failed[JobT]]


def locate_failures(job: Job, error: SampleDecodeError, decodes_alone: Callable[[Job], bool]) -> SampleDecodeError:
    """``error`` with its failing positions: as the decoder named them, else those of
    the samples that fail when ``decodes_alone`` runs each by itself.

    Raises:
        SampleDecodeError: ``error`` itself, when every sample decodes alone: the run
            failed for another reason than its samples, and none is to be blamed.
    """
    if error.failures:
        return error
    failing = [p for p in range(len(job)) if not decodes_alone(job.only([p]))]
    if not failing:
        raise error
    return SampleDecodeError(error.detail, {p: error.detail for p in failing})
