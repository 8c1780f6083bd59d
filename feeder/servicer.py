"""The gRPC layer: protobuf messages in, the service's own objects out and back.
No decisions are made here; errors map through ``core.errors``."""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Iterator
from typing import NoReturn

import grpc

from core.errors import ConfigError, FeederError, InvalidArgument, grpc_code
from feeder.pipeline import AugmentKind, CropRange
from feeder.plan import LastBatch
from feeder.service import MAX_IMAGE_SIZE, MIN_IMAGE_SIZE, FeederService, StreamSpec
from protos import feeder_pb2, feeder_pb2_grpc
from transport.daemon import TransportRequest

log = logging.getLogger(__name__)

__all__ = ["FeederServicer", "add_to_server", "stream_spec"]

_LAST_BATCH = {feeder_pb2.LAST_BATCH_DROP: LastBatch.DROP, feeder_pb2.LAST_BATCH_PAD: LastBatch.PAD}
_AUGMENT = {
    feeder_pb2.AUGMENT_AUTO: None,
    feeder_pb2.AUGMENT_TRAIN: AugmentKind.TRAIN,
    feeder_pb2.AUGMENT_VAL: AugmentKind.VAL,
}


# Inclusive ranges of the request's integer fields that do not depend on the daemon's
# configuration or the dataset (the service checks those: batch size against
# ``max_batch_size``, the cursor against the rank's part). Epochs stay far below
# int64 so that ``epoch + epochs`` and the per-epoch seeds cannot overflow.
MAX_EPOCH = 2**31 - 1
MAX_WORLD_SIZE = 1 << 20
_INT_RANGES: dict[str, tuple[int, int]] = {
    "epoch": (0, MAX_EPOCH),
    "epochs": (0, MAX_EPOCH),
    "rank": (0, MAX_WORLD_SIZE - 1),
    "world_size": (1, MAX_WORLD_SIZE),
    "local_world_size": (0, MAX_WORLD_SIZE),
    "batch_size": (1, 2**31 - 1),
    "image_size": (MIN_IMAGE_SIZE, MAX_IMAGE_SIZE),
    "start_cursor": (0, 2**63 - 1),
    "max_samples": (0, 2**63 - 1),
}
# RandomResizedCrop limits a request may set (0 means the default). Below 1 % of the
# area a crop of a typical photo is a few pixels wide; ratios past 10:1 are slivers.
MIN_CROP_SCALE = 0.01
CROP_RATIOS = (0.1, 10.0)
_FLOAT_RANGES: dict[str, tuple[float, float]] = {
    "min_scale": (MIN_CROP_SCALE, 1.0),
    "max_scale": (MIN_CROP_SCALE, 1.0),
    "min_ratio": CROP_RATIOS,
    "max_ratio": CROP_RATIOS,
}


def _check_numbers(request: feeder_pb2.StreamRequest) -> None:
    """Range-check every numeric field of ``request`` (the message names the field)."""
    for name, (lo, hi) in _INT_RANGES.items():
        value = getattr(request, name)
        if not lo <= value <= hi:
            raise InvalidArgument(f"{name}: {value} is not in {lo}..{hi}")
    last_epoch = request.epoch + max(1, request.epochs) - 1
    if last_epoch > MAX_EPOCH:
        raise InvalidArgument(f"epochs: {request.epochs} epochs from epoch {request.epoch} pass {MAX_EPOCH}")
    if request.rank >= request.world_size:
        raise InvalidArgument(f"rank: {request.rank} is not in 0..{request.world_size - 1} "
                              f"(world_size {request.world_size})")
    for name, (low, high) in _FLOAT_RANGES.items():
        number = getattr(request, name)
        if number != 0 and not (math.isfinite(number) and low <= number <= high):
            raise InvalidArgument(f"{name}: {number:g} is not 0 (default) or in {low:g}..{high:g}")
    crop = _crop_values(request)
    for lower, upper in (("min_scale", "max_scale"), ("min_ratio", "max_ratio")):
        if crop[lower] > crop[upper]:
            raise InvalidArgument(f"{lower}: {crop[lower]:g} is above {upper} {crop[upper]:g}")


def _crop_values(request: feeder_pb2.StreamRequest) -> dict[str, float]:
    """The request's crop limits by field name, zeros replaced by the defaults."""
    default = CropRange()
    return {name: getattr(request, name) or getattr(default, name) for name in _FLOAT_RANGES}


def stream_spec(request: feeder_pb2.StreamRequest, peer: str = "") -> StreamSpec:
    """The service's view of a ``StreamRequest``; the one place its values are
    range-checked.

    Raises:
        InvalidArgument: a number out of range, an enum value or crop range that does
            not exist (the message starts with the field's name).
    """
    if request.last_batch not in _LAST_BATCH:
        raise InvalidArgument(f"last_batch: unknown value {request.last_batch}")
    if request.augment not in _AUGMENT:
        raise InvalidArgument(f"augment: unknown value {request.augment}")
    _check_numbers(request)
    try:
        crop = CropRange(**_crop_values(request))
    except ConfigError as e:
        raise InvalidArgument(str(e)) from e
    return StreamSpec(
        dataset=request.dataset,
        split=request.split,
        rank=request.rank,
        world_size=request.world_size,
        batch_size=request.batch_size,
        image_size=request.image_size,
        seed=request.seed,
        epoch=request.epoch,
        start_cursor=request.start_cursor,
        max_samples=request.max_samples,
        epochs=max(1, request.epochs),
        last_batch=_LAST_BATCH[request.last_batch],
        augment=_AUGMENT[request.augment],
        crop=crop,
        job_id=request.job_id,
        peer=peer,
        local_world_size=request.local_world_size,
        antialias=request.antialias if request.HasField("antialias") else None,
    )


class FeederServicer(feeder_pb2_grpc.FeederServicer):
    """Implements ``feeder.v1.Feeder`` on top of a :class:`FeederService`."""

    def __init__(self, service: FeederService) -> None:
        self.service = service

    def _abort(self, context: grpc.ServicerContext, error: FeederError) -> NoReturn:
        self.service.metrics.error(type(error).__name__)
        log.warning("%s from %s: %s: %s", grpc_code(error).name, context.peer(), type(error).__name__, error)
        context.abort(grpc_code(error), str(error))
        raise error  # context.abort raises; this line keeps type checkers honest

    def ListDatasets(self, request, context):  # noqa: N802 - gRPC method name
        datasets = []
        for name, dataset in sorted(self.service.datasets.items()):
            splits = [
                feeder_pb2.SplitInfo(name=s, num_samples=len(index))
                for s, index in sorted(dataset.splits.items())
            ]
            datasets.append(feeder_pb2.DatasetInfo(name=name, splits=splits, classes=dataset.classes))
        return feeder_pb2.ListDatasetsResponse(datasets=datasets)

    def StreamBatches(self, request, context) -> Iterator[bytes]:  # noqa: N802
        try:
            stream = self.service.open_stream(stream_spec(request, context.peer()), cancel=context.cancel,
                                              transport=TransportRequest.from_message(request))
        except FeederError as e:
            self._abort(context, e)
        context.add_callback(stream.close)
        try:
            # Already serialized by the stream's transport (pixels inline or in a
            # slot); this method has no response serializer (see ``add_to_server``).
            for batch in stream:
                yield stream.encode(batch)
        except FeederError as e:
            self._abort(context, e)
        finally:
            stream.close()

    def ReleaseSlots(self, request, context):  # noqa: N802
        try:
            released = self.service.transports.release(request.slots)
        except FeederError as e:
            self._abort(context, e)
        return feeder_pb2.ReleaseResponse(released=released)

    def GetStats(self, request, context):  # noqa: N802
        return feeder_pb2.StatsResponse(**dataclasses.asdict(self.service.metrics.stats()))


def add_to_server(servicer: FeederServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as ``feeder.v1.Feeder``, like the generated
    ``add_FeederServicer_to_server`` except that batches go out as the bytes the
    stream's transport serialized (no second serialization)."""
    pb = feeder_pb2
    handlers = {
        "ListDatasets": grpc.unary_unary_rpc_method_handler(
            servicer.ListDatasets,
            request_deserializer=pb.ListDatasetsRequest.FromString,
            response_serializer=pb.ListDatasetsResponse.SerializeToString,
        ),
        "StreamBatches": grpc.unary_stream_rpc_method_handler(
            servicer.StreamBatches,
            request_deserializer=pb.StreamRequest.FromString,
            response_serializer=None,
        ),
        "ReleaseSlots": grpc.unary_unary_rpc_method_handler(
            servicer.ReleaseSlots,
            request_deserializer=pb.ReleaseRequest.FromString,
            response_serializer=pb.ReleaseResponse.SerializeToString,
        ),
        "GetStats": grpc.unary_unary_rpc_method_handler(
            servicer.GetStats,
            request_deserializer=pb.StatsRequest.FromString,
            response_serializer=pb.StatsResponse.SerializeToString,
        ),
    }
    name = pb.DESCRIPTOR.services_by_name["Feeder"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
    server.add_registered_method_handlers(name, handlers)
