"""The gRPC layer: protobuf messages in, the service's own objects out and back.
No decisions are made here; errors map through ``core.errors``."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import NoReturn

import grpc

from core.errors import FeederError, grpc_code
from feeder.log_lines import DETAIL_CHARS, clip
from feeder.serve_options import option_texts
from feeder.service import FeederService
from protocol.request import from_request
from protos import feeder_pb2, feeder_pb2_grpc
from transport.daemon import TransportRequest

log = logging.getLogger(__name__)

__all__ = ["FeederServicer", "add_to_server"]


class FeederServicer(feeder_pb2_grpc.FeederServicer):
    """Implements ``feeder.v1.Feeder`` on top of a :class:`FeederService`."""

    def __init__(self, service: FeederService) -> None:
        self.service = service
        self._serve_options = option_texts(service.config)  # the same for every call

    def _abort(self, context: grpc.ServicerContext, error: FeederError) -> NoReturn:
        self.service.metrics.error(type(error).__name__)
        # The message may echo client input (a dataset name): bounded in the log and the status.
        log.warning("%s from %s: %s: %s", grpc_code(error).name, clip(context.peer()), type(error).__name__,
                    clip(error, DETAIL_CHARS))
        context.abort(grpc_code(error), clip(error, DETAIL_CHARS))
        raise error  # context.abort raises; this line keeps type checkers honest

    def ListDatasets(self, request, context):  # noqa: N802 - gRPC method name
        datasets = []
        for name, dataset in sorted(self.service.datasets.items()):
            splits = [
                feeder_pb2.SplitInfo(name=s, num_samples=len(index), index_sha256=index.index_sha256)
                for s, index in sorted(dataset.splits.items())
            ]
            datasets.append(feeder_pb2.DatasetInfo(name=name, splits=splits, classes=dataset.classes,
                                                   manifest_sha256=dataset.manifest_sha256))
        config = self.service.config
        return feeder_pb2.ListDatasetsResponse(datasets=datasets, max_batch_size=config.budgets.max_batch_size,
                                               max_epoch_samples=config.budgets.max_epoch_samples,
                                               pixel_options=config.pixel_options,
                                               shm_dir=str(Path(config.shm.shm_dir).resolve()),
                                               serve_options=self._serve_options)

    def StreamBatches(self, request, context) -> Iterator[bytes]:  # noqa: N802
        try:
            spec = from_request(request)
            stream = self.service.open_stream(spec, context.peer(), cancel=context.cancel,
                                              transport=TransportRequest.of(spec))
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
            released = self.service.parts.transports.release(request.slots)
        except FeederError as e:
            self._abort(context, e)
        return feeder_pb2.ReleaseResponse(released=released)

    def GetStats(self, request, context):  # noqa: N802
        return feeder_pb2.StatsResponse(**self.service.metrics.stats().fields())


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
