"""The loader's channel to one daemon and the calls made on it besides streaming:
``ListDatasets`` (what the daemon serves, and its limits) and ``ReleaseSlots``."""

from __future__ import annotations

from typing import Any

import grpc

from clients.channel import open_channel, resolve_token
from clients.config import LoaderConfig
from clients.spec import MixInfo, SplitInfo
from clients.verdicts import error_from_rpc
from core.errors import NotFound, ServiceUnavailable
from protos import feeder_pb2, feeder_pb2_grpc
from transport.client import STREAM_BATCHES, SlotReleaser

__all__ = ["Connection"]

# A 256 x 288 x 288 x 3 batch is 64 MB; gRPC's 4 MB default would refuse it.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                    ("grpc.max_send_message_length", -1)]


class Connection:
    """The channel to one daemon and the calls made on it.

    Args:
        config: The token and TLS files to connect with.
        address: The daemon's address.
        host_name: The host name ``address`` was found under: the daemon's TLS
            certificate is checked against it instead of the address; None: the
            address itself.

    Raises:
        ConfigError: a TLS file cannot be read, or ``FEEDER_TOKEN`` is not a token.
    """

    def __init__(self, config: LoaderConfig, address: str, host_name: str | None = None) -> None:
        self.address = address
        options: list[tuple[str, Any]] = list(_CHANNEL_OPTIONS)
        if host_name is not None and config.tls_root is not None:
            options.append(("grpc.ssl_target_name_override", host_name))
        self.channel = open_channel(address, options, resolve_token(config.token),
                                    config.tls_root, config.tls_cert, config.tls_key)
        self.stub = feeder_pb2_grpc.FeederStub(self.channel)
        # Batches arrive as the bytes sent: the transport's receiver parses them.
        self.stream_batches = self.channel.unary_stream(
            STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        self.releaser = SlotReleaser(self.stub.ReleaseSlots)

    def describe(self, dataset: str, split: str, timeout_s: float) -> SplitInfo:
        """What the daemon serves as ``dataset``/``split``, and its limits.

        Raises:
            ServiceUnavailable: no answer within ``timeout_s``.
            NotFound: the daemon does not serve that dataset or split.
            FeederError: the daemon refused the call (e.g. ``Unauthenticated``).
        """
        return self._split_of(self._list(timeout_s), dataset, split)

    def describe_mix(self, datasets: tuple[str, ...], split: str, timeout_s: float) -> MixInfo:
        """What the daemon serves as each dataset of a mix (their ``split``), from one
        ``ListDatasets``.

        Raises:
            NotFound: the daemon does not serve one of the datasets, or one of them
                has no such split (names which).
            ServiceUnavailable, FeederError: as :meth:`describe`.
        """
        reply = self._list(timeout_s)
        return MixInfo.of(tuple((name, self._split_of(reply, name, split)) for name in datasets))

    def _list(self, timeout_s: float) -> feeder_pb2.ListDatasetsResponse:
        try:
            grpc.channel_ready_future(self.channel).result(timeout=timeout_s)
            reply = self.stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            raise ServiceUnavailable(f"daemon {self.address} not reachable within {timeout_s:.0f} s") from e
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from e
        return reply

    def _split_of(self, reply: feeder_pb2.ListDatasetsResponse, dataset: str, split: str) -> SplitInfo:
        info = next((d for d in reply.datasets if d.name == dataset), None)
        if info is None:
            names = [d.name for d in reply.datasets]
            raise NotFound(f"daemon {self.address} does not serve dataset {dataset!r} (it serves {names})")
        found = next((s for s in info.splits if s.name == split), None)
        if found is None:
            names = [s.name for s in info.splits]
            raise NotFound(f"daemon {self.address}: dataset {dataset!r} has no split {split!r} (splits: {names})")
        return SplitInfo(found.num_samples, list(info.classes), reply.max_batch_size, info.manifest_sha256,
                         found.index_sha256, dict(reply.pixel_options), reply.max_epoch_samples)

    def close(self) -> None:
        """Stops handing slots back and closes the channel."""
        self.releaser.close()
        self.channel.close()
