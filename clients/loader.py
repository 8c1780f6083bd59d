"""``FeederLoader``: batches from a feeder daemon, on the device, ready to train on."""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import grpc
import numpy as np
import torch

from clients.channel import check_address, check_token, open_channel, resolve_token
from clients.fetcher import HostBatch, StreamFetcher, error_from_rpc
from clients.position import Position, Positioned
from clients.transfer import DeviceTransfer
from core.errors import ConfigError, NotFound, ServiceUnavailable
from protos import feeder_pb2, feeder_pb2_grpc
from transport.base import HostIdentity
from transport.client import STREAM_BATCHES, SlotReleaser

__all__ = ["FeederLoader", "LoaderConfig", "resolve_rank"]

_LAST_BATCH = {"drop": feeder_pb2.LAST_BATCH_DROP, "pad": feeder_pb2.LAST_BATCH_PAD}
_TRANSPORTS = {"auto": feeder_pb2.TRANSPORT_AUTO, "shm": feeder_pb2.TRANSPORT_SHM,
               "grpc": feeder_pb2.TRANSPORT_GRPC}
_AUGMENT = {"auto": feeder_pb2.AUGMENT_AUTO, "train": feeder_pb2.AUGMENT_TRAIN,
            "val": feeder_pb2.AUGMENT_VAL}
# A 256 x 288 x 288 x 3 batch is 64 MB; gRPC's 4 MB default would refuse it.
_CHANNEL_OPTIONS = [("grpc.max_receive_message_length", -1),
                    ("grpc.max_send_message_length", -1)]


def _gpu_uuid(device: torch.device) -> str:
    """The CUDA device's UUID (names the GPU whatever CUDA_VISIBLE_DEVICES says);
    empty for a CPU consumer."""
    if device.type != "cuda":
        return ""
    from transport.cuda_ipc import device_uuid  # torch.cuda only for a CUDA consumer

    return device_uuid(device.index if device.index is not None else torch.cuda.current_device())


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


def resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    """Rank and world size: as given, else from torch.distributed, else torchrun's env."""
    if rank is not None and world_size is not None:
        return rank, world_size
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        found = torch.distributed.get_rank(), torch.distributed.get_world_size()
    else:
        found = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    return (found[0] if rank is None else rank), (found[1] if world_size is None else world_size)


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


# Epochs one stream runs on for when no size change is planned: the daemon plans each
# epoch only when it gets there, so a long stream costs nothing up front.
_EPOCHS_PER_STREAM = 1000


class _Sizes(NamedTuple):
    """What a stream is opened with and cannot change: batch size, image size and the
    crop's minimum scale (as the request's float32 carries it)."""

    batch_size: int
    image_size: int
    min_scale: float

    @classmethod
    def of(cls, request: feeder_pb2.StreamRequest) -> _Sizes:
        return cls(request.batch_size, request.image_size, request.min_scale)


@dataclass(frozen=True)
class LoaderConfig:
    """Everything a ``FeederLoader`` is built with (its keyword arguments), checked
    once here.

    Args:
        address: ``host:port`` of the daemon, ``[v6]:port``, ``dns:///host:port``, or
            ``unix:/path`` of its socket.
        dataset: Name of a dataset the daemon serves.
        split: Split of the dataset (``train``, ``val``).
        batch_size: Samples per batch, per rank.
        image_size: Side of the square output images, pixels.
        seed: Seed of the shuffle plan (the same on every rank).
        rank: This rank; None: from torch.distributed or torchrun's ``RANK``.
        world_size: Ranks in the job; None: as for ``rank``.
        device: Where the tensors go (``"cuda"`` means the current CUDA device).
        normalize: Convert to ``dtype`` with the ImageNet mean/std, else keep uint8.
        channels_last: NHWC memory layout behind the NCHW shape.
        last_batch: ``"drop"`` (equal full batches on every rank) or ``"pad"`` (every
            sample once; the last batch is filled with repeats, see ``return_padding``).
        return_keys: Also yield the list of sample keys.
        return_padding: Also yield a bool tensor, True where a sample is a repeat: to
            fill the last batch, or in place of a sample the daemon could not serve
            (see :attr:`FeederLoader.skipped`).
        dtype: Floating dtype of normalised images.
        augment: ``"auto"`` (train augmentation on ``train``), ``"train"`` or ``"val"``.
        min_scale: RandomResizedCrop minimum area fraction (0: daemon default).
        job_id: Identifies the job to the daemon (ranks of one job share it).
        prefetch_batches: Ready batches held in memory per loader.
        prefetch_next_epoch: Open the next epoch's stream as soon as the consumer has
            drained the current one, before it asks for the next epoch's first batch.
        transport: How pixels come from a daemon on this host: ``"auto"`` (shared
            memory when this process can share the daemon's ``/dev/shm``, else inside
            the gRPC messages, with one log line saying why), ``"shm"`` or ``"grpc"``.
            ``loader.transport`` says which one is in use.
        shm_dir: The shared-memory directory (the daemon's ``--shm-dir``).
        connect_timeout_s: How long the first contact may take.
        reconnect_timeout_s: How long to keep reconnecting after the daemon goes away
            (or stalls), counted from the first failure in a row; then
            ``ServiceUnavailable`` names the daemon, dataset, split, rank and cursor.
        stall_timeout_s: How long a stream may send nothing while the loader waits for
            a batch before it is cancelled and reopened at the cursor (a daemon that
            stopped sending without ending the stream); counted in ``reconnects``.
            It also bounds the wait for a stream's first batch, which includes the
            daemon building its pipeline, hence the generous default.
        token: The daemon's token (its ``--token-file``), sent with every call as
            ``authorization: Bearer <token>``; None: the ``FEEDER_TOKEN`` environment
            variable, read when the loader is created, if it is set.
        tls_root: PEM file of the CA that signed the daemon's TLS certificate; None:
            plaintext.
        tls_cert: This client's PEM certificate, for a daemon that requires one
            (``--tls-client-ca``); with ``tls_key`` and ``tls_root``.
        tls_key: Private key of ``tls_cert``.
    """

    address: str
    dataset: str
    split: str = "train"
    batch_size: int = 256
    image_size: int = 224
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    device: str | torch.device = "cpu"
    normalize: bool = True
    channels_last: bool = True
    last_batch: str = "drop"
    return_keys: bool = False
    return_padding: bool = False
    dtype: torch.dtype = torch.float32
    augment: str = "auto"
    min_scale: float = 0.0
    job_id: str = ""
    prefetch_batches: int = 4
    prefetch_next_epoch: bool = True
    transport: str = "auto"
    shm_dir: Path = Path("/dev/shm")
    connect_timeout_s: float = 30.0
    reconnect_timeout_s: float = 60.0
    stall_timeout_s: float = 120.0
    token: str | None = field(default=None, repr=False)  # never in logs
    tls_root: str | Path | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None

    def __post_init__(self) -> None:
        check_address(self.address)
        if self.last_batch not in _LAST_BATCH:
            raise ConfigError(f"last_batch must be one of {sorted(_LAST_BATCH)}, got {self.last_batch!r}")
        if self.augment not in _AUGMENT:
            raise ConfigError(f"augment must be one of {sorted(_AUGMENT)}, got {self.augment!r}")
        if self.transport not in _TRANSPORTS:
            raise ConfigError(f"transport must be one of {sorted(_TRANSPORTS)}, got {self.transport!r}")
        if self.prefetch_batches < 1:
            raise ConfigError(f"prefetch_batches must be >= 1, got {self.prefetch_batches}")
        for name in ("connect_timeout_s", "reconnect_timeout_s", "stall_timeout_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ConfigError(f"{name} must be positive, got {getattr(self, name)}")
        _check_batch_size(self.batch_size)
        _check_image_size(self.image_size)
        _check_min_scale(self.min_scale)
        if self.token is not None:
            check_token(self.token)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_cert is not None and self.tls_root is None:
            raise ConfigError("tls_root: a client certificate needs TLS (give the daemon's CA as tls_root)")


def _check_batch_size(batch_size: int) -> None:
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")


def _check_image_size(image_size: int) -> None:
    if image_size < 1:
        raise ConfigError(f"image_size must be >= 1, got {image_size}")


def _check_min_scale(min_scale: float) -> None:
    if not 0 <= min_scale <= 1:
        raise ConfigError(f"min_scale must be in [0, 1], got {min_scale}")


class _Connection:
    """The loader's channel and its current stream: what a loader gives back however
    it ends (``close()``, garbage collection, interpreter exit). It holds no reference
    to the loader, so a finalizer of the loader can own it.

    Args:
        channel: the open channel to the daemon.
    """

    def __init__(self, channel: grpc.Channel) -> None:
        self.channel = channel
        self.stub = feeder_pb2_grpc.FeederStub(self.channel)
        # Batches arrive as the bytes sent: the transport's receiver parses them.
        self.stream_batches = channel.unary_stream(
            STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
        self.releaser = SlotReleaser(self.stub.ReleaseSlots)
        self.fetcher: StreamFetcher | None = None
        self.successor: StreamFetcher | None = None  # opened ahead of a planned size change

    def release(self) -> None:
        """Ends the streams (their threads and the daemon's side) and closes the channel."""
        for fetcher in (self.fetcher, self.successor):
            if fetcher is not None:
                fetcher.close()
        self.fetcher = self.successor = None
        self.releaser.close()
        self.channel.close()


class FeederLoader(Positioned):
    """An iterable of ``(images, labels)`` streamed from a feeder daemon.

    Images are ``[B, 3, H, W]`` on ``device`` (normalised ``dtype`` or uint8), labels
    int64. Batches are prefetched by a background thread, so the training step does
    not wait on a network round trip. Position is ``(epoch, sample cursor)``:
    iterating yields the rest of the current epoch, then moves to the next one.

    Args:
        address: ``host:port`` of the daemon, or ``unix:/path`` of its socket.
        dataset: Name of a dataset the daemon serves.
        options: the other fields of :class:`LoaderConfig` by name (``split``,
            ``batch_size``, ``image_size``, ``seed``, ``rank``, ``world_size``,
            ``device``, ``normalize``, ``token``, ``tls_root``, ...), each
            documented there.

    Raises:
        ServiceUnavailable: The daemon cannot be reached within ``connect_timeout_s``.
        NotFound: The daemon does not serve ``dataset`` / ``split``.
        ConfigError: An argument out of range.
        TypeError: An option that is not a field of ``LoaderConfig``.
    """

    def __init__(self, address: str, dataset: str, **options: Any) -> None:
        config = LoaderConfig(address=address, dataset=dataset, **options)
        self.config = config
        self.address, self.dataset, self.split = address, dataset, config.split
        self.seed, self.last_batch, self.augment = config.seed, config.last_batch, config.augment
        self.return_keys, self.return_padding = config.return_keys, config.return_padding
        self.job_id = config.job_id
        self.rank, self.world_size = resolve_rank(config.rank, config.world_size)
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"rank {self.rank} outside world of {self.world_size}")
        self.device = _resolve_device(config.device)
        self._transfer = DeviceTransfer(self.device, config.normalize, config.channels_last, config.dtype)
        self._batch_size, self._image_size = config.batch_size, config.image_size
        self._min_scale = config.min_scale
        channel = open_channel(address, _CHANNEL_OPTIONS, resolve_token(config.token),
                               config.tls_root, config.tls_cert, config.tls_key)
        self._connection = _Connection(channel)
        # Runs once: on close(), when the loader is collected, or at interpreter exit.
        self._release = weakref.finalize(self, self._connection.release)
        self.num_samples, self.classes = self._describe(config.connect_timeout_s)
        self._samples_per_rank = self._expected_samples_per_rank()
        self.position = Position()
        self._host = HostIdentity.of_this_process(config.shm_dir)
        # Ranks of this job on this node: torchrun says; else all of them (a daemon
        # serves one node, so a job that does not say is taken to be on it).
        self._local_world_size = min(int(os.environ.get("LOCAL_WORLD_SIZE", self.world_size)), self.world_size)
        self._last_transport = ""
        self._pending: HostBatch | None = None  # first batch of the next epoch, already taken
        self._planned: dict[int, _Sizes] = {}  # epoch -> sizes from then on
        self.wait_seconds = 0.0
        self._reconnects = 0
        self._skipped = 0
        self._epoch_wait_s = self._epoch_wall_s = 0.0

    # -- what the daemon has -------------------------------------------------
    def _describe(self, timeout_s: float) -> tuple[int, list[str]]:
        try:
            grpc.channel_ready_future(self._connection.channel).result(timeout=timeout_s)
            reply = self._connection.stub.ListDatasets(feeder_pb2.ListDatasetsRequest(), timeout=timeout_s)
        except grpc.FutureTimeoutError as e:
            raise ServiceUnavailable(
                f"daemon {self.address} not reachable within {timeout_s:.0f} s"
            ) from e
        except grpc.RpcError as e:
            raise error_from_rpc(e, self.address) from e
        for info in reply.datasets:
            if info.name != self.dataset:
                continue
            for split in info.splits:
                if split.name == self.split:
                    return split.num_samples, list(info.classes)
            names = [s.name for s in info.splits]
            raise NotFound(f"daemon {self.address}: dataset {self.dataset!r} has no split "
                           f"{self.split!r} (splits: {names})")
        names = [d.name for d in reply.datasets]
        raise NotFound(f"daemon {self.address} does not serve dataset {self.dataset!r} "
                       f"(it serves {names})")

    def _expected_samples_per_rank(self) -> int:
        if self.last_batch == "pad":
            return math.ceil(self.num_samples / self.world_size)
        return self.num_samples // self.world_size

    # -- position and sizes --------------------------------------------------
    @property
    def samples_per_rank(self) -> int:
        """Length of this rank's part of an epoch, in samples."""
        return self._samples_per_rank

    @property
    def batch_size(self) -> int:
        """Samples per batch from the next batch on."""
        return self._batch_size

    @property
    def image_size(self) -> int:
        """Image side in pixels from the next batch on."""
        return self._image_size

    @property
    def transport(self) -> str:
        """What carries this loader's pixels: ``shm`` (shared memory with a daemon on
        this host), ``grpc`` (inside the messages) or ``cuda_ipc``; empty before the
        first batch."""
        fetcher = self._connection.fetcher
        return (fetcher.transport if fetcher is not None else "") or self._last_transport

    @property
    def reconnects(self) -> int:
        """Times a stream was reopened after a transient failure."""
        fetcher = self._connection.fetcher
        return self._reconnects + (fetcher.reconnects if fetcher else 0)

    @property
    def skipped(self) -> int:
        """Samples the daemon could not serve (undecodable, or over its pixel cap) that
        arrived replaced by a repeat of another sample of their batch, marked as
        padding (``feeder serve --on-error skip``); the daemon logs and names them."""
        return self._skipped

    @property
    def stall_fraction(self) -> float:
        """Share of the current (or last) epoch's iteration time spent waiting for data."""
        return self._epoch_wait_s / self._epoch_wall_s if self._epoch_wall_s > 0 else 0.0

    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; a no-op if already in it (keeps a resumed cursor)."""
        if self.position.move_to_epoch(epoch):
            self._drop_fetchers()

    def set_batch_size(self, batch_size: int) -> None:
        """Batch size from the next batch on (a stream opened ahead by :meth:`plan_sizes`
        takes over, or the stream reopens at the cursor)."""
        _check_batch_size(batch_size)
        self._batch_size = batch_size

    def set_image_size(self, image_size: int) -> None:
        """Image side from the next batch on (as :meth:`set_batch_size`)."""
        _check_image_size(image_size)
        self._image_size = image_size

    def set_min_scale(self, min_scale: float) -> None:
        """RandomResizedCrop minimum area fraction from the next batch on (0: default)."""
        _check_min_scale(min_scale)
        self._min_scale = min_scale

    def plan_sizes(self, epoch: int, batch_size: int, image_size: int, min_scale: float = 0.0) -> None:
        """Announce that from the start of ``epoch`` on the sizes will be these (a
        schedule's phase change). The stream before it then ends at that epoch, and the
        next one is opened as soon as the daemon has sent the last batch before it, so
        the daemon works on the new phase while the consumer drains the old one. The
        sizes still take effect through ``set_*``; a plan that does not match them
        only costs the stream opened ahead."""
        _check_batch_size(batch_size)
        _check_image_size(image_size)
        _check_min_scale(min_scale)
        self._planned[epoch] = _Sizes(batch_size, image_size, float(np.float32(min_scale)))

    def __len__(self) -> int:
        """Batches left in the current epoch for this rank (equal on every rank)."""
        return self._batches_after(self.position.cursor, self._batch_size)

    def _batches_after(self, cursor: int, batch_size: int) -> int:
        remaining = max(self._samples_per_rank - cursor, 0)
        if self.last_batch == "pad":
            return math.ceil(remaining / batch_size)
        return remaining // batch_size

    # -- resumable state -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: epoch and sample cursor (not a batch index)."""
        return self.position.state_dict() | {"seed": self.seed, "world_size": self.world_size,
                                             "dataset": self.dataset, "split": self.split}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state``: the next batch starts at its cursor.

        Raises:
            ConfigError: The state was saved for another dataset, split, seed or world.
        """
        for key in ("dataset", "split", "seed", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"loader state is for {key}={state[key]!r}, "
                                  f"this loader has {getattr(self, key)!r}")
        self.position.load_state_dict(state)
        self._drop_fetchers()

    # -- iteration -------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        self._epoch_wait_s = self._epoch_wall_s = 0.0
        started = time.perf_counter()
        while len(self) > 0:
            waited = time.perf_counter()
            host = self._next_host_batch()
            if host is None:
                break
            out = self._deliver(host)
            now = time.perf_counter()
            self._account(now - waited, now - started)
            yield out
        self._end_epoch()
        self._epoch_wall_s = time.perf_counter() - started

    def _account(self, wait_s: float, wall_s: float) -> None:
        self.wait_seconds += wait_s
        self._epoch_wait_s += wait_s
        self._epoch_wall_s = wall_s

    def _next_host_batch(self) -> HostBatch | None:
        """The next batch of the current epoch, or None when the stream has no more
        of it (the next epoch's first batch is kept for the next pass)."""
        host: HostBatch | None
        if self._pending is not None:
            host, self._pending = self._pending, None
        else:
            fetcher = self._fetcher_here()
            host = fetcher.get()
            self._open_successor(fetcher)
        if host is not None and host.meta.epoch != self.position.epoch:
            self._pending = host
            return None
        return host

    @property
    def _sizes(self) -> _Sizes:
        return _Sizes(self._batch_size, self._image_size, float(np.float32(self._min_scale)))

    def _fetcher_here(self) -> StreamFetcher:
        """The stream that delivers the next batch at the current position and sizes:
        the open one, else the one opened ahead, else a new one."""
        conn, here = self._connection, (self.position.epoch, self.position.cursor)
        if conn.fetcher is not None and _Sizes.of(conn.fetcher.request) == self._sizes:
            return conn.fetcher
        successor = conn.successor
        if successor is not None and _Sizes.of(successor.request) == self._sizes and \
                (successor.request.epoch, successor.request.start_cursor) == here:
            conn.successor = None
            self._drop_fetchers()
            conn.fetcher = successor
            return successor
        self._drop_fetchers()
        conn.fetcher = self._start_fetcher(*here, self._sizes)
        return conn.fetcher

    def _open_successor(self, fetcher: StreamFetcher) -> None:
        """Once ``fetcher`` has received its stream's last batch (the daemon's side is
        done; the consumer still has the queued ones to drain), open the planned next."""
        planned = self._planned.get(fetcher.end_epoch)
        if planned is None or self._connection.successor is not None or self._connection.fetcher is not fetcher:
            return
        batch_size = fetcher.request.batch_size
        received_all = fetcher.finished.is_set() or (
            fetcher.epoch == fetcher.end_epoch - 1 and self._batches_after(fetcher.cursor, batch_size) == 0)
        if received_all:
            self._connection.successor = self._start_fetcher(fetcher.end_epoch, 0, planned)

    def _deliver(self, host: HostBatch) -> tuple[Any, ...]:
        meta = host.meta
        self.position.cursor = meta.cursor
        self._skipped += len(meta.failed_keys)
        if meta.samples_per_rank:
            self._samples_per_rank = meta.samples_per_rank
        images, labels, padding = self._transfer(host.images, host.labels, host.padding, ready=host.ready)
        if not _shares_memory(images, host.images):  # copied out: the slot can go back now
            host.release(self._transfer.copied)
        out: tuple[Any, ...] = (images, labels)
        if self.return_keys:
            out += (meta.keys,)
        if self.return_padding:
            out += (padding,)
        return out

    def _end_epoch(self) -> None:
        self.position.next_epoch()
        conn = self._connection
        if not self.config.prefetch_next_epoch:
            self._drop_fetchers()
        elif conn.fetcher is None or conn.fetcher.end_epoch <= self.position.epoch:
            if conn.successor is None:  # nothing streams the next epoch yet: open it now
                self._drop_fetchers()
                conn.fetcher = self._start_fetcher(self.position.epoch, 0, self._sizes)

    def _start_fetcher(self, epoch: int, cursor: int, sizes: _Sizes) -> StreamFetcher:
        """A stream from (epoch, cursor) at ``sizes``, running on across epochs until the
        next planned size change (one epoch without ``prefetch_next_epoch``)."""
        if self.config.prefetch_next_epoch:
            end = min([e for e in self._planned if e > epoch], default=epoch + _EPOCHS_PER_STREAM)
        else:
            end = epoch + 1
        request = feeder_pb2.StreamRequest(
            dataset=self.dataset, split=self.split, job_id=self.job_id, seed=self.seed,
            epoch=epoch, epochs=end - epoch, rank=self.rank, world_size=self.world_size,
            batch_size=sizes.batch_size, image_size=sizes.image_size, start_cursor=cursor,
            last_batch=_LAST_BATCH[self.last_batch], augment=_AUGMENT[self.augment],
            min_scale=sizes.min_scale, transport=_TRANSPORTS[self.config.transport],
            local_world_size=self._local_world_size,
            client_host=self._host.to_message(_gpu_uuid(self.device)),
        )
        conn = self._connection
        return StreamFetcher(conn.stream_batches, request, self.address,
                             self.config.prefetch_batches, self.config.reconnect_timeout_s,
                             pin=self.device.type == "cuda", stall_timeout_s=self.config.stall_timeout_s,
                             release=conn.releaser, shm_dir=self.config.shm_dir)

    def _drop_fetchers(self) -> None:
        """Close the open stream and any opened ahead; forget a taken-ahead batch."""
        conn = self._connection
        for fetcher in (conn.fetcher, conn.successor):
            if fetcher is not None:
                self._last_transport = fetcher.transport or self._last_transport
                self._reconnects += fetcher.reconnects
                fetcher.close()
        conn.fetcher = conn.successor = None
        self._pending = None

    def close(self) -> None:
        """Stops prefetching and closes the connection; a second call does nothing.

        A loader that is dropped without ``close()`` is closed when it is
        garbage-collected, or at the latest when the interpreter exits.
        """
        self._drop_fetchers()
        self._release()

    def __enter__(self) -> FeederLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
