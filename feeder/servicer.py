"""The gRPC layer: protobuf messages in, the service's own objects out and back.
No decisions are made here; errors map through ``core.errors``."""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator
from typing import NoReturn

import grpc
import numpy as np

from core.errors import ConfigError, FeederError, InvalidArgument, grpc_code
from core.wire import BYTES, field_key, varint
from feeder.pipeline import AugmentKind, CropRange
from feeder.plan import LastBatch
from feeder.producer import ReadyBatch
from feeder.service import FeederService, StreamSpec
from protos import feeder_pb2, feeder_pb2_grpc

log = logging.getLogger(__name__)

__all__ = ["FeederServicer", "add_to_server", "batch_message", "encode_batch", "stream_spec"]

_LAST_BATCH = {feeder_pb2.LAST_BATCH_DROP: LastBatch.DROP, feeder_pb2.LAST_BATCH_PAD: LastBatch.PAD}
_AUGMENT = {
    feeder_pb2.AUGMENT_AUTO: None,
    feeder_pb2.AUGMENT_TRAIN: AugmentKind.TRAIN,
    feeder_pb2.AUGMENT_VAL: AugmentKind.VAL,
}


def _crop(request: feeder_pb2.StreamRequest) -> CropRange:
    default = CropRange()
    try:
        return CropRange(
            min_scale=request.min_scale or default.min_scale,
            max_scale=request.max_scale or default.max_scale,
            min_ratio=request.min_ratio or default.min_ratio,
            max_ratio=request.max_ratio or default.max_ratio,
        )
    except ConfigError as e:
        raise InvalidArgument(str(e)) from e


def stream_spec(request: feeder_pb2.StreamRequest, peer: str = "") -> StreamSpec:
    """The service's view of a ``StreamRequest``.

    Raises:
        InvalidArgument: an enum value or crop range that does not exist.
    """
    if request.last_batch not in _LAST_BATCH:
        raise InvalidArgument(f"last_batch: unknown value {request.last_batch}")
    if request.augment not in _AUGMENT:
        raise InvalidArgument(f"augment: unknown value {request.augment}")
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
        epochs=max(1, request.epochs) if request.epochs >= 0 else request.epochs,
        last_batch=_LAST_BATCH[request.last_batch],
        augment=_AUGMENT[request.augment],
        crop=_crop(request),
        job_id=request.job_id,
        peer=peer,
        antialias=request.antialias if request.HasField("antialias") else None,
    )


# Key of the ``images`` field: field number, wire type 2 (length-delimited).
_IMAGES_KEY = field_key(feeder_pb2.Batch.DESCRIPTOR.fields_by_name["images"].number, BYTES)


def batch_message(batch: ReadyBatch, with_images: bool = True) -> feeder_pb2.Batch:
    """A ``Batch`` message for ``batch`` (pixels as raw bytes unless ``with_images``
    is False)."""
    return feeder_pb2.Batch(
        epoch=batch.epoch,
        cursor=batch.cursor,
        keys=batch.keys,
        labels=batch.labels.tolist(),
        images=batch.images.tobytes() if with_images else b"",
        shape=list(batch.images.shape),
        padding=batch.padding.tolist(),
        samples_per_rank=batch.samples_per_rank,
        failed_keys=batch.failed_keys,
    )


def encode_batch(batch: ReadyBatch) -> bytes:
    """The serialized ``Batch`` message of ``batch``, with the pixels copied once.

    Protobuf would copy the pixels three times (array -> bytes -> message ->
    wire); here the small fields are serialized by protobuf and the ``images`` field
    is appended straight from the array. Parsers accept fields in any order, so the
    result reads as an ordinary ``Batch``.
    """
    pixels = np.ascontiguousarray(batch.images).data.cast("B")
    head = batch_message(batch, with_images=False).SerializeToString()
    return b"".join((head, _IMAGES_KEY, varint(pixels.nbytes), pixels))


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

    def StreamBatches(self, request, context) -> Iterator[ReadyBatch]:  # noqa: N802
        try:
            stream = self.service.open_stream(stream_spec(request, context.peer()))
        except FeederError as e:
            self._abort(context, e)
        context.add_callback(stream.close)
        try:
            # Yields the service's own batches: ``encode_batch`` is this method's
            # response serializer (see ``add_to_server``).
            yield from stream
        except FeederError as e:
            self._abort(context, e)
        finally:
            stream.close()

    def GetStats(self, request, context):  # noqa: N802
        return feeder_pb2.StatsResponse(**dataclasses.asdict(self.service.metrics.stats()))


def add_to_server(servicer: FeederServicer, server: grpc.Server) -> None:
    """Register ``servicer`` as ``feeder.v1.Feeder``, like the generated
    ``add_FeederServicer_to_server`` except that batches go out through
    :func:`encode_batch`."""
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
            response_serializer=encode_batch,
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
