"""One rank's request for batches, :class:`StreamSpec`, checked once: the loader
builds one and checks it when it is constructed, the daemon reads one from each
``StreamRequest`` (:func:`from_request`) and checks it the same way, so a client
learns at construction, with the daemon's own message, what the daemon would refuse.

The checks here depend on nothing but the request. What depends on the daemon (its
``--max-batch-size``) or on the dataset (the rank's part, for the cursor) is checked
by the daemon when the stream opens. A request's crop limits (:mod:`protocol.crop`)
and where its client runs (:mod:`protocol.client_host`) have modules of their own,
their names importable from here too.
"""

from __future__ import annotations

import enum
import math
import re
from dataclasses import dataclass, field
from typing import Any

from core.errors import InvalidArgument
from protocol.client_host import ClientHost
from protocol.crop import CROP_LIMITS, CROP_RATIOS, MIN_CROP_SCALE, CropRange
from protocol.identity import Identity
from protocol.plan import LastBatch, Segment
from protos import feeder_pb2

__all__ = [
    "CROP_RATIOS",
    "MAX_BATCH_BYTES",
    "MAX_BATCH_STRIDE",
    "MAX_EPOCH",
    "MAX_EPOCH_SAMPLES",
    "MAX_IMAGE_SIZE",
    "MAX_WORLD_SIZE",
    "MIN_CROP_SCALE",
    "MIN_IMAGE_SIZE",
    "AugmentKind",
    "ClientHost",
    "CropRange",
    "MixPart",
    "StreamSpec",
    "from_request",
    "mix_name",
    "to_request",
]

MIN_IMAGE_SIZE = 16
MAX_IMAGE_SIZE = 1024
# protobuf refuses messages of 2 GiB or more; keep a batch's pixels well below.
MAX_BATCH_BYTES = 1 << 30
# Epochs stay far below int64 so that ``epoch + epochs`` and the per-epoch seeds
# cannot overflow.
MAX_EPOCH = 2**31 - 1
MAX_WORLD_SIZE = 1 << 20
# Daemons one rank may draw from (the stride of a share of its stream).
MAX_BATCH_STRIDE = 1024
# Samples per epoch of a mix: its plan's integer arithmetic multiplies two of them
# within int64 (protocol/mix.py), and an epoch's order is held in memory.
MAX_EPOCH_SAMPLES = 2**31 - 1
_MAX_INT32 = 2**31 - 1
_SHA256 = re.compile(r"[0-9a-f]{64}")
_MAX_INT64 = 2**63 - 1


class AugmentKind(str, enum.Enum):
    """Which transform a stream applies: RandomResizedCrop and flips (and a shuffled
    order, unless the request's ``shuffle`` says otherwise), or the validation centre
    crop (in stored order, unless ``shuffle`` says otherwise)."""

    TRAIN = "train"
    VAL = "val"


@dataclass(frozen=True)
class MixPart:
    """One dataset of a mixed stream.

    Attributes:
        dataset: its name on the daemon.
        weight: its weight (positive, finite; only the weights' ratios count).
        manifest_sha256, index_sha256: what the daemon must serve under the name
            (:mod:`protocol.identity`; "" not checked).
    """

    dataset: str
    weight: float
    manifest_sha256: str = ""
    index_sha256: str = ""


def mix_name(parts: tuple[MixPart, ...]) -> str:
    """The ``dataset`` of a mixed request: the names joined with ``+`` (what a daemon
    that knows no mixes looks up, and refuses)."""
    return "+".join(part.dataset for part in parts)


def _check_sha256(name: str, value: str) -> None:
    if value and not _SHA256.fullmatch(value):
        raise InvalidArgument(f"{name}: {value[:80]!r} is not a sha256 (64 hex digits)")


def _check_mix(spec: StreamSpec) -> None:
    """A mix's parts (names given once, positive finite weights) and epoch length.

    Raises:
        InvalidArgument: naming the field (``mix[1].weight: ...``).
    """
    if not spec.mix:
        if spec.epoch_samples:
            raise InvalidArgument(f"epoch_samples: {spec.epoch_samples} without a mix (only a mix sets it)")
        return
    seen: set[str] = set()
    for k, part in enumerate(spec.mix):
        if not part.dataset:
            raise InvalidArgument(f"mix[{k}].dataset: empty")
        if part.dataset in seen:
            raise InvalidArgument(f"mix[{k}].dataset: {part.dataset[:80]!r} given twice")
        seen.add(part.dataset)
        if not (math.isfinite(part.weight) and part.weight > 0):
            raise InvalidArgument(f"mix[{k}].weight: {part.weight!r} for {part.dataset[:80]!r} is not a positive "
                                  "finite number")
        _check_sha256(f"mix[{k}].manifest_sha256", part.manifest_sha256)
        _check_sha256(f"mix[{k}].index_sha256", part.index_sha256)
    if not 1 <= spec.epoch_samples <= MAX_EPOCH_SAMPLES:
        raise InvalidArgument(f"epoch_samples: {spec.epoch_samples} is not in 1..{MAX_EPOCH_SAMPLES}")
    if spec.dataset != mix_name(spec.mix):
        raise InvalidArgument(f"dataset: {spec.dataset[:80]!r} for a mix of {mix_name(spec.mix)[:80]!r} (a mix's "
                              "dataset is its names joined with '+')")
    if spec.manifest_sha256 or spec.index_sha256:
        raise InvalidArgument("manifest_sha256: a mix carries each dataset's in its part")


# Inclusive ranges of the integer fields (batch_size is also checked against the
# daemon's limit, start_cursor against the rank's part).
_INT_RANGES: dict[str, tuple[int, int]] = {
    "seed": (-(2**63), _MAX_INT64),
    "epoch": (0, MAX_EPOCH),
    "epochs": (1, MAX_EPOCH),
    "rank": (0, MAX_WORLD_SIZE - 1),
    "world_size": (1, MAX_WORLD_SIZE),
    "local_world_size": (0, MAX_WORLD_SIZE),
    "batch_size": (1, _MAX_INT32),
    "image_size": (MIN_IMAGE_SIZE, MAX_IMAGE_SIZE),
    "start_cursor": (0, _MAX_INT64),
    "max_samples": (0, _MAX_INT64),
    "batch_stride": (1, MAX_BATCH_STRIDE),
    "prefetch_batches": (0, _MAX_INT32),
}
_TRANSPORTS = frozenset(feeder_pb2.Transport.values())


@dataclass(frozen=True)
class StreamSpec:
    """A request for one rank's batches (fields as in ``StreamRequest``).

    ``augment`` None means: train augmentation for the split named ``train``,
    validation transform otherwise. ``shuffle`` None: each epoch's order is a seeded
    permutation under train augmentation and the stored order under validation
    (:attr:`shuffled`); True or False says so whatever the augmentation.
    ``epochs`` streams ``epoch``, ``epoch + 1``, ... back to back; the cursor and
    ``max_samples`` apply to the first. ``job_id`` names the job (its ranks share
    it). ``antialias`` None: the daemon's default resize filter. ``consumed``: what
    the job read of ``epoch`` at earlier world sizes (an elastic resume: the rank's
    part is of the rest, see :func:`protocol.plan.remaining_order`). ``batch_stride``
    and ``batch_offset``: only every ``batch_stride``-th batch from ``batch_offset``
    (counted across the stream's epochs), a rank's share of a pool of daemons.
    ``manifest_sha256``, ``index_sha256``, ``pixel_options_sha256``: what the daemon
    must serve (:mod:`protocol.identity`; "" not checked). ``mix``: the datasets of a
    mixed stream (``dataset`` is then :func:`mix_name` of them, and each part carries
    its own manifest and index digests) and ``epoch_samples`` its epoch's length
    (:mod:`protocol.mix`). ``transport``: the ``feeder.v1.Transport`` the client asks
    for (0: auto); ``client_host``: where the client runs (None: not said, a remote
    client); ``prefetch_batches``: batches it holds ready beyond the one it
    consumes (0: not said).

    Raises:
        InvalidArgument: a field out of range (the message starts with its name).
    """

    dataset: str
    split: str
    rank: int = 0
    world_size: int = 1
    batch_size: int = 32
    image_size: int = 224
    seed: int = 0
    epoch: int = 0
    start_cursor: int = 0
    max_samples: int = 0
    epochs: int = 1
    last_batch: LastBatch = LastBatch.DROP
    augment: AugmentKind | None = None
    crop: CropRange = field(default_factory=CropRange)
    job_id: str = ""
    antialias: bool | None = None
    local_world_size: int = 0  # the job's ranks on the client's node (0: not said)
    consumed: tuple[Segment, ...] = ()
    batch_stride: int = 1
    batch_offset: int = 0
    manifest_sha256: str = ""
    index_sha256: str = ""
    pixel_options_sha256: str = ""
    mix: tuple[MixPart, ...] = ()
    epoch_samples: int = 0
    transport: int = feeder_pb2.TRANSPORT_AUTO
    client_host: ClientHost | None = None
    prefetch_batches: int = 0
    shuffle: bool | None = None

    def __post_init__(self) -> None:
        for name, (low, high) in _INT_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise InvalidArgument(f"{name}: {value} is not in {low}..{high}")
        if self.transport not in _TRANSPORTS:
            raise InvalidArgument(f"transport: unknown value {self.transport}")
        if self.shuffle is not None and not isinstance(self.shuffle, bool):
            raise InvalidArgument(f"shuffle: {self.shuffle!r:.80} is not true, false or unset")
        if self.epoch + self.epochs - 1 > MAX_EPOCH:
            raise InvalidArgument(f"epochs: {self.epochs} epochs from epoch {self.epoch} pass {MAX_EPOCH}")
        if not 0 <= self.batch_offset < self.batch_stride:
            raise InvalidArgument(f"batch_offset: {self.batch_offset} is not in 0..{self.batch_stride - 1} "
                                  f"(batch_stride {self.batch_stride})")
        if self.rank >= self.world_size:
            raise InvalidArgument(f"rank: {self.rank} is not in 0..{self.world_size - 1} "
                                  f"(world_size {self.world_size})")
        for k, segment in enumerate(self.consumed):
            if not 1 <= segment.world_size <= MAX_WORLD_SIZE or len(segment.cursors) != segment.world_size:
                raise InvalidArgument(f"consumed[{k}]: {len(segment.cursors)} cursors for world_size "
                                      f"{segment.world_size} (1..{MAX_WORLD_SIZE})")
            if any(not 0 <= c <= _MAX_INT64 for c in segment.cursors):
                raise InvalidArgument(f"consumed[{k}]: a cursor below 0")
        for name in ("manifest_sha256", "index_sha256", "pixel_options_sha256"):
            _check_sha256(name, getattr(self, name))
        _check_mix(self)
        if self.batch_size * self.image_size**2 * 3 > MAX_BATCH_BYTES:
            raise InvalidArgument(f"batch_size: {self.batch_size} images of {self.image_size} px exceed "
                                  f"{MAX_BATCH_BYTES >> 20} MiB per message")

    @property
    def identity(self) -> Identity:
        """What the daemon must serve for this request (a plain one)."""
        return Identity(self.manifest_sha256, self.index_sha256, self.pixel_options_sha256)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The datasets streamed: the mix's, in the order given, or ``dataset``."""
        return tuple(part.dataset for part in self.mix) if self.mix else (self.dataset,)

    def identities(self) -> dict[str, Identity]:
        """What the daemon must serve under each dataset's name."""
        if not self.mix:
            return {self.dataset: self.identity}
        return {part.dataset: Identity(part.manifest_sha256, part.index_sha256, self.pixel_options_sha256)
                for part in self.mix}

    @property
    def kind(self) -> AugmentKind:
        """The transform applied (``augment``, or the split's default)."""
        if self.augment is not None:
            return self.augment
        return AugmentKind.TRAIN if self.split == "train" else AugmentKind.VAL

    @property
    def shuffled(self) -> bool:
        """Whether each epoch's order is a seeded permutation: ``shuffle``, or where
        unset, whether the transform is train augmentation."""
        return self.kind is AugmentKind.TRAIN if self.shuffle is None else self.shuffle

    @property
    def batch_bytes(self) -> int:
        """Bytes of one full batch's uint8 pixels."""
        return self.batch_size * self.image_size**2 * 3


_LAST_BATCH = {feeder_pb2.LAST_BATCH_DROP: LastBatch.DROP, feeder_pb2.LAST_BATCH_PAD: LastBatch.PAD}
_AUGMENT = {
    feeder_pb2.AUGMENT_AUTO: None,
    feeder_pb2.AUGMENT_TRAIN: AugmentKind.TRAIN,
    feeder_pb2.AUGMENT_VAL: AugmentKind.VAL,
}
# Fields copied as they are between StreamSpec and StreamRequest.
_SAME = ("dataset", "split", "job_id", "seed", "epoch", "rank", "world_size", "batch_size", "image_size",
         "start_cursor", "max_samples", "local_world_size", "batch_offset", "manifest_sha256", "index_sha256",
         "pixel_options_sha256", "epoch_samples", "transport", "prefetch_batches")


def _crop(request: feeder_pb2.StreamRequest) -> CropRange:
    default = CropRange()
    values = {name: getattr(request, name) for name in CROP_LIMITS}
    return CropRange(**{name: value or getattr(default, name) for name, value in values.items()})


def from_request(request: feeder_pb2.StreamRequest) -> StreamSpec:
    """The checked spec of a ``StreamRequest`` (0 in a crop limit means the default,
    ``epochs`` 0 means 1).

    Raises:
        InvalidArgument: an unknown enum value or a field out of range (the message
            starts with the field's name).
    """
    if request.last_batch not in _LAST_BATCH:
        raise InvalidArgument(f"last_batch: unknown value {request.last_batch}")
    if request.augment not in _AUGMENT:
        raise InvalidArgument(f"augment: unknown value {request.augment}")
    if request.epochs < 0:
        raise InvalidArgument(f"epochs: {request.epochs} is not in 0..{MAX_EPOCH}")
    if request.batch_stride < 0:
        raise InvalidArgument(f"batch_stride: {request.batch_stride} is not in 0..{MAX_BATCH_STRIDE}")
    return StreamSpec(
        **{name: getattr(request, name) for name in _SAME},
        epochs=max(1, request.epochs),
        batch_stride=max(1, request.batch_stride),
        last_batch=_LAST_BATCH[request.last_batch],
        augment=_AUGMENT[request.augment],
        crop=_crop(request),
        antialias=request.antialias if request.HasField("antialias") else None,
        shuffle=request.shuffle if request.HasField("shuffle") else None,
        consumed=tuple(Segment(s.world_size, tuple(s.cursors)) for s in request.consumed),
        mix=tuple(MixPart(p.dataset, p.weight, p.manifest_sha256, p.index_sha256) for p in request.mix),
        client_host=ClientHost.of_request(request),
    )


# The tables read backwards, for requests the loader sends.
_LAST_BATCH_WIRE: dict[LastBatch, Any] = {value: number for number, value in _LAST_BATCH.items()}
_AUGMENT_WIRE: dict[AugmentKind | None, Any] = {value: number for number, value in _AUGMENT.items()}


def to_request(spec: StreamSpec) -> feeder_pb2.StreamRequest:
    """The ``StreamRequest`` of ``spec``."""
    request = feeder_pb2.StreamRequest(
        **{name: getattr(spec, name) for name in _SAME},
        epochs=spec.epochs,
        batch_stride=spec.batch_stride,
        last_batch=_LAST_BATCH_WIRE[spec.last_batch],
        augment=_AUGMENT_WIRE[spec.augment],
        min_scale=spec.crop.min_scale, max_scale=spec.crop.max_scale,
        min_ratio=spec.crop.min_ratio, max_ratio=spec.crop.max_ratio,
    )
    if spec.antialias is not None:
        request.antialias = spec.antialias
    if spec.shuffle is not None:
        request.shuffle = spec.shuffle
    if spec.client_host is not None:
        request.client_host.CopyFrom(spec.client_host.to_message())
    for segment in spec.consumed:
        request.consumed.add(world_size=segment.world_size, cursors=segment.cursors)
    for part in spec.mix:
        request.mix.add(dataset=part.dataset, weight=part.weight, manifest_sha256=part.manifest_sha256,
                        index_sha256=part.index_sha256)
    return request
