"""What a loader asks its daemon for: the :class:`protocol.request.StreamSpec` of each
of its streams, checked when the loader is built the way the daemon checks it.

A mixed stream's specs carry each dataset's name, weight and identity (the daemons'
answers for each, :class:`MixInfo`) and the epoch's length; its plan's batches are
numbered from that length alone, as the daemon numbers them.

A spec is checked as the daemon reads it (``from_request(to_request(spec))``: the wire
rounds the crop limits to float32), so a value the daemon would refuse is refused
here with the daemon's own message, raised as ``ConfigError``. What depends on the
daemon and the dataset is checked against what ``ListDatasets`` said
(:class:`SplitInfo`): the daemon's ``--max-batch-size`` and ``--max-epoch-samples``
(same messages as the daemon), and a ``drop`` batch larger than the rank's part (every epoch empty: the daemon
refuses it too).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Protocol

from clients.elastic import Resume
from core.errors import ConfigError, InvalidArgument
from protocol.identity import Identity, digest_for
from protocol.mix import check_epoch_length, check_shares, epoch_counts, union_classes
from protocol.plan import LastBatch, Segment, check_epochs_hold_batches, plan_length, remaining_length
from protocol.request import CropRange, MixPart, StreamSpec, from_request, to_request
from protocol.stream_plan import StreamWindow, stream_window

__all__ = ["MixInfo", "Sizes", "SplitInfo", "StreamSpecs", "make_spec", "respec"]


class _Cut(Protocol):
    """How a loader cuts its epochs (a :class:`clients.config.LoaderConfig`)."""

    @property
    def partial(self) -> bool: ...

    @property
    def max_batches_per_epoch(self) -> int: ...


@dataclass(frozen=True)
class Sizes:
    """What a stream is opened with and cannot change.

    Attributes:
        batch_size: Samples per batch.
        image_size: Side of the output images, pixels.
        min_scale: RandomResizedCrop minimum area fraction; 0: the daemon's default.
    """

    batch_size: int
    image_size: int
    min_scale: float = 0.0

    def fields(self) -> dict[str, Any]:
        """The ``StreamSpec`` fields these sizes set.

        Raises:
            InvalidArgument: ``min_scale`` out of the request's range.
        """
        crop = CropRange() if self.min_scale == 0 else CropRange(min_scale=self.min_scale)
        return {"batch_size": self.batch_size, "image_size": self.image_size, "crop": crop}


@dataclass(frozen=True)
class SplitInfo:
    """What the daemon said (``ListDatasets``) about a split and its own limits.

    Attributes:
        num_samples: Samples in the split.
        classes: Class names, in label order.
        max_batch_size: The daemon's ``--max-batch-size``; 0: not said (an older daemon).
        manifest_sha256: The dataset's manifest identity ("" from an older daemon).
        index_sha256: The split's index identity ("" from an older daemon).
        pixel_options: The daemon's options that change pixels (empty from an older
            daemon; see :mod:`protocol.identity`).
        max_epoch_samples: The daemon's ``--max-epoch-samples``; 0: not said (an
            older daemon).
    """

    num_samples: int
    classes: list[str]
    max_batch_size: int = 0
    manifest_sha256: str = ""
    index_sha256: str = ""
    pixel_options: dict[str, str] = field(default_factory=dict)
    max_epoch_samples: int = 0

    def identity(self, antialias: bool | None = None) -> Identity:
        """What a daemon must serve for a request of ``antialias`` to stand in for this one."""
        return Identity(self.manifest_sha256, self.index_sha256, digest_for(self.pixel_options, antialias))


@dataclass(frozen=True)
class MixInfo(SplitInfo):
    """What the daemon said about each dataset of a mix, as one split: its samples
    are all theirs, its classes the union of theirs in the order given, its manifest
    and index digests theirs joined with ``+`` (two daemons serve the same mix when
    they are the same).

    Attributes:
        parts: each dataset's name and split, in the mix's order.
    """

    parts: tuple[tuple[str, SplitInfo], ...] = ()

    @classmethod
    def of(cls, parts: tuple[tuple[str, SplitInfo], ...]) -> MixInfo:
        """The mix of ``parts`` (answers of one daemon)."""
        infos = [info for _, info in parts]
        classes, _ = union_classes([info.classes for info in infos])
        return cls(sum(info.num_samples for info in infos), classes, infos[0].max_batch_size,
                   "+".join(info.manifest_sha256 for info in infos), "+".join(info.index_sha256 for info in infos),
                   dict(infos[0].pixel_options), infos[0].max_epoch_samples, parts)


@contextmanager
def _refused_as_config() -> Iterator[None]:
    try:
        yield
    except InvalidArgument as e:
        raise ConfigError(str(e)) from e


def _as_read(spec: StreamSpec) -> StreamSpec:
    return from_request(to_request(spec))


def make_spec(sizes: Sizes, **fields: Any) -> StreamSpec:
    """A ``StreamSpec`` of ``sizes`` and ``fields``, as the daemon reads it.

    Raises:
        ConfigError: what the daemon would refuse, with its message.
    """
    with _refused_as_config():
        return _as_read(StreamSpec(**fields, **sizes.fields()))


def respec(spec: StreamSpec, sizes: Sizes | None = None, **changes: Any) -> StreamSpec:
    """``spec`` with ``sizes`` and ``changes``, as the daemon reads it.

    Raises:
        ConfigError: what the daemon would refuse, with its message.
    """
    with _refused_as_config():
        size_fields = sizes.fields() if sizes is not None else {}
        return _as_read(dataclasses.replace(spec, **size_fields, **changes))


class StreamSpecs:
    """The specs of one loader's streams: ``base`` with each stream's epoch, cursor,
    epoch count and sizes.

    Args:
        base: The fields every stream of the loader shares (checked: see
            :func:`make_spec`); its sizes are the loader's first.
        split: What the daemon said about the split.

    Raises:
        ConfigError: ``base``'s sizes refused (see :meth:`check`).
    """

    def __init__(self, base: StreamSpec, split: SplitInfo) -> None:
        self.base = _with_identity(base, split)  # carried by every request, checked on every open
        self.split = split
        # Samples of an epoch: the split's, or the mix's epoch_samples.
        self.epoch_length = base.epoch_samples if base.mix else split.num_samples
        # Length of this rank's part of a whole epoch.
        self.samples_per_rank = plan_length(self.epoch_length, base.world_size, base.last_batch)
        # Epoch -> what the job read of it at earlier world sizes (an elastic resume).
        self.consumed: dict[int, tuple[Segment, ...]] = {}
        if base.mix:  # the daemon's own check of the weights' shares
            with _refused_as_config():
                check_shares(base.datasets, [part.weight for part in base.mix], self.epoch_length)
        self._check_daemon_limits(base.batch_size)

    @property
    def epoch_counts(self) -> dict[str, int]:
        """Samples each dataset gives an epoch (one dataset: the split's size)."""
        if not self.base.mix:
            return {self.base.dataset: self.epoch_length}
        counts = epoch_counts([part.weight for part in self.base.mix], self.epoch_length)
        return dict(zip(self.base.datasets, counts))

    def part_length(self, epoch: int) -> int:
        """Length of this rank's part of ``epoch``: of the whole epoch, or of what the
        earlier ranks left of it."""
        consumed = self.consumed.get(epoch, ())
        if not consumed:
            return self.samples_per_rank
        with _refused_as_config():
            rest = remaining_length(self.epoch_length, consumed, self.base.last_batch)
        return plan_length(rest, self.base.world_size, self.base.last_batch)

    def identity(self, mix: tuple[tuple[str, float], ...]) -> dict[str, Any]:
        """What a loader state must share with these specs' loader (configured with
        ``mix``) to load into it: the plan as the daemon makes it, the wire's
        last-batch policy and shuffle included (see :func:`clients.elastic.check_identity`)."""
        base = self.base
        mine: dict[str, Any] = {"dataset": base.dataset,  # a mix's: its names joined with +
                                "split": base.split, "seed": base.seed, "manifest_sha256": self.split.manifest_sha256,
                                "epoch_samples": self.epoch_length, "last_batch": base.last_batch.value,
                                "shuffle": base.shuffled, "augment": base.kind.value}
        whole = len(mix) == 1 and self.epoch_length == self.split.num_samples
        if mix and not whole:  # a mix of one over its whole split is the plain stream
            mine["mix"] = [[name, weight] for name, weight in mix]
        return mine

    def progress(self, epoch: int, cursor: int) -> float:
        """Share of ``epoch`` the whole job has consumed (0 to 1) with this rank at
        ``cursor``, what earlier ranks consumed before a resume at another world size
        included (the ranks are at one cursor)."""
        total, world = self.epoch_length, self.base.world_size
        before = total - remaining_length(total, self.consumed.get(epoch, ()), self.base.last_batch)
        part = self.part_length(epoch)
        whole = before + part * world
        return (before + min(cursor, part) * world) / whole if whole else 0.0

    def resume_at(self, at: Resume, sizes: Sizes) -> None:
        """Take the segments of a resume at ``at`` (its epoch's, at earlier world
        sizes) once its position is one the daemon would open at ``sizes``.

        Raises:
            ConfigError: a position the daemon would refuse, segments that cannot
                describe the epoch, a cursor past the rank's part (nothing changed).
        """
        self.spec(at.epoch, at.cursor, sizes, consumed=at.consumed)
        before = self.consumed
        self.consumed = {at.epoch: at.consumed} if at.consumed else {}
        try:
            part = self.part_length(at.epoch)  # refuses segments that cannot describe the epoch
            if at.cursor > part:
                raise ConfigError(f"loader state: cursor {at.cursor} is past the end of rank {self.base.rank}'s part "
                                  f"of epoch {at.epoch} ({part} samples at world_size {self.base.world_size})")
        except ConfigError:
            self.consumed = before
            raise

    def spec(self, epoch: int, cursor: int, sizes: Sizes, epochs: int = 1,
             consumed: tuple[Segment, ...] = (), max_samples: int = 0, transport: int | None = None) -> StreamSpec:
        """The spec of a stream of ``epochs`` epochs from ``(epoch, cursor)`` at ``sizes``
        (``consumed``: of ``epoch``, at earlier world sizes; ``max_samples``: of the
        first epoch, 0 for all; ``transport``: in place of the configured one, None
        for that).

        Raises:
            ConfigError: what the daemon would refuse, with its message.
        """
        changes = {} if transport is None else {"transport": transport}
        return respec(self.base, sizes, epoch=epoch, start_cursor=cursor, epochs=epochs, consumed=consumed,
                      max_samples=max_samples, **changes)

    def window(self, spec: StreamSpec) -> StreamWindow:
        """The batches of a stream of ``spec`` (one of these specs), numbered as the
        daemon numbers them: by the same function, from the same request.

        Raises:
            ConfigError: what the daemon would refuse, with its message.
        """
        with _refused_as_config():
            return stream_window(spec, self.epoch_length)

    def check(self, sizes: Sizes, epoch: int | None = None) -> None:
        """Refuse ``sizes`` (from ``epoch`` on) where the daemon would, or where they
        would make empty epochs.

        Raises:
            ConfigError: a value the daemon refuses, a batch over its
                ``--max-batch-size``, or a ``drop`` batch larger than the rank's part.
        """
        self.spec(self.base.epoch if epoch is None else epoch, 0, sizes)
        self._check_daemon_limits(sizes.batch_size)

    def real_length(self, epoch: int | None) -> int:
        """Samples of this rank's part of ``epoch`` (None: a whole one) that are not
        repeats: its share of the epoch (or of what earlier ranks left of it), under
        ``pad`` one more on the first ``N % world_size`` ranks. The repeats come after
        all of them."""
        consumed, total = self.consumed.get(epoch, ()) if epoch is not None else (), self.epoch_length
        if consumed:
            with _refused_as_config():
                total = remaining_length(total, consumed, self.base.last_batch)
        world, rank = self.base.world_size, self.base.rank
        return total // world + (self.base.last_batch is LastBatch.PAD and rank < total % world)

    def batches_after(self, cursor: int, batch_size: int, epoch: int | None = None, partial: bool = False) -> int:
        """Batches of the part of ``epoch`` (None: a whole one) after ``cursor``, as the
        daemon's plan cuts them; ``partial``: leaving out a last batch of repeats only."""
        part = self.samples_per_rank if epoch is None else self.part_length(epoch)
        if partial:
            part = self.real_length(epoch)
        remaining = max(part - cursor, 0)
        if self.base.last_batch is LastBatch.PAD:
            return -(-remaining // batch_size)
        return remaining // batch_size

    def batches_handed(self, epoch: int, cursor: int, batch_size: int, cut: _Cut) -> int:
        """Batches of ``epoch`` after ``cursor`` that a loader hands out: as the plan cuts
        them (under ``cut.partial`` without a last batch of repeats only), and of the
        epoch's first ``cut.max_batches_per_epoch`` (0: all)."""
        left = self.batches_after(cursor, batch_size, epoch, cut.partial)
        cap = cut.max_batches_per_epoch
        return min(left, max(0, -(-(cap * batch_size - cursor) // batch_size))) if cap else left

    def _check_daemon_limits(self, batch_size: int) -> None:
        limit = self.split.max_batch_size
        if limit and batch_size > limit:  # the daemon's own message
            raise ConfigError(f"batch_size: {batch_size} is not in 1..{limit}")
        base = self.base
        try:  # the daemon's own checks
            if base.mix and self.split.max_epoch_samples:
                check_epoch_length(self.epoch_length, self.split.max_epoch_samples, self.split.num_samples)
            check_epochs_hold_batches(self.epoch_length, base.world_size, base.rank, batch_size,
                                      base.last_batch, f"{base.dataset}/{base.split}")
        except InvalidArgument as e:
            raise ConfigError(str(e)) from e


def _with_identity(base: StreamSpec, split: SplitInfo) -> StreamSpec:
    """``base`` carrying what the daemons said they serve: the manifest and index of
    its dataset, or of each dataset of its mix, and the pixel options' digest."""
    served = split.identity(base.antialias)
    if not base.mix:
        return respec(base, manifest_sha256=served.manifest_sha256, index_sha256=served.index_sha256,
                      pixel_options_sha256=served.pixel_options_sha256)
    infos = dict(split.parts) if isinstance(split, MixInfo) else {}
    parts = tuple(MixPart(part.dataset, part.weight, infos[part.dataset].manifest_sha256,
                          infos[part.dataset].index_sha256) if part.dataset in infos else part for part in base.mix)
    return respec(base, mix=parts, pixel_options_sha256=served.pixel_options_sha256)
