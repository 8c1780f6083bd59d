"""``FeederLoader``: batches from a feeder daemon, on the device, ready to train on.

The loader composes the pieces: what it asks for (:mod:`clients.spec`, checked when it
is built), the streams that deliver it (:mod:`clients.streams`), where it is
(:mod:`clients.position`) and the copy to the device (:mod:`clients.transfer`).
"""

from __future__ import annotations

import os
import threading
import time
import warnings
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from clients.fetcher import HostBatch
from clients.loader_config import LoaderConfig
from clients.position import Position, Positioned
from clients.spec import Sizes, StreamSpecs
from clients.streams import Connection, Streams
from clients.transfer import DeviceTransfer
from core.errors import ConfigError
from protocol.request import MAX_WORLD_SIZE, StreamSpec
from transport.base import HostIdentity

__all__ = ["FeederLoader", "LoaderConfig", "resolve_rank"]


class _MovedToConfig:
    """An attribute a loader once had of its own, now read from ``loader.config``
    (with a deprecation warning)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, loader: FeederLoader | None, owner: type | None = None) -> Any:
        if loader is None:
            return self
        warnings.warn(f"FeederLoader.{self.name} is deprecated; use loader.config.{self.name}",
                      DeprecationWarning, stacklevel=2)
        return getattr(loader.config, self.name)


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


def _local_world_size(world_size: int) -> int:
    """Ranks of this job on this node: torchrun says; else all of them (a daemon
    serves one node, so a job that does not say is taken to be on it)."""
    return max(0, min(int(os.environ.get("LOCAL_WORLD_SIZE", world_size)), world_size, MAX_WORLD_SIZE))


def _resolve_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _checked_specs(connection: Connection, config: LoaderConfig, base: StreamSpec) -> StreamSpecs:
    """The loader's requests, ``base`` checked against the daemon's answer to
    ``ListDatasets``; closes ``connection`` if that fails."""
    try:
        return StreamSpecs(base, connection.describe(config.dataset, config.split, config.connect_timeout_s))
    except BaseException:
        connection.close()
        raise


class FeederLoader(Positioned):
    """An iterable of ``(images, labels)`` streamed from a feeder daemon.

    Images are ``[B, 3, H, W]`` on ``device`` (normalised ``dtype`` or uint8), labels
    int64. Batches are prefetched by a background thread, so the training step does
    not wait on a network round trip. Position is ``(epoch, sample cursor)``:
    iterating yields the rest of the current epoch, then moves to the next one. One
    pass at a time: a second iteration while one is under way (from another thread)
    raises ``RuntimeError``.

    Every argument is a field of :class:`LoaderConfig`, same name, type and default,
    documented there. The loader refuses at construction what the daemon would
    refuse when the first stream opens: each request is checked with the daemon's
    own checks (:mod:`protocol.request`), its message raised as ``ConfigError``.

    Raises:
        ConfigError: An argument out of range or that the daemon would refuse (an
            ``image_size`` or ``min_scale`` out of its range, a ``world_size`` over
            its limit, a ``batch_size`` over its ``--max-batch-size`` or, under
            ``drop``, larger than this rank's part), or an ``address`` that is not
            one (``host:port``, ``[v6]:port``, ``dns:///host:port``, ``unix:/path``).
        ServiceUnavailable: The daemon cannot be reached within ``connect_timeout_s``.
        NotFound: The daemon does not serve ``dataset`` / ``split``.
        Unauthenticated: The daemon wants another token.
    """

    def __init__(
        self,
        address: str,
        dataset: str,
        *,
        split: str = "train",
        batch_size: int = 256,
        image_size: int = 224,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        device: str | torch.device = "cpu",
        normalize: bool = True,
        channels_last: bool = True,
        last_batch: str = "drop",
        return_keys: bool = False,
        return_padding: bool = False,
        dtype: torch.dtype = torch.float32,
        augment: str = "auto",
        min_scale: float = 0.0,
        job_id: str = "",
        prefetch_batches: int = 4,
        prefetch_next_epoch: bool = True,
        transport: str = "auto",
        shm_dir: Path = Path("/dev/shm"),
        connect_timeout_s: float = 30.0,
        reconnect_timeout_s: float = 60.0,
        stall_timeout_s: float = 120.0,
        token: str | None = None,
        tls_root: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
    ) -> None:
        # First statement: the arguments are LoaderConfig's fields (a test keeps them so).
        config = LoaderConfig(**{name: value for name, value in locals().items() if name != "self"})
        self.config = config
        self.rank, self.world_size = resolve_rank(config.rank, config.world_size)
        base = config.stream_spec(self.rank, self.world_size, _local_world_size(self.world_size))
        self.device = _resolve_device(config.device)
        self._transfer = DeviceTransfer(self.device, config.normalize, config.channels_last, config.dtype)
        client_host = HostIdentity.of_this_process(config.shm_dir).to_message(_gpu_uuid(self.device))
        connection = Connection(config)
        self._specs = _checked_specs(connection, config, base)
        self._streams = Streams(connection, self._specs, config, client_host, pin=self.device.type == "cuda")
        # Runs once: on close(), when the loader is collected, or at interpreter exit.
        self._release = weakref.finalize(self, self._streams.release)
        self.position = Position()
        self._sizes = config.sizes
        self.num_samples, self.classes = self._specs.split.num_samples, self._specs.split.classes
        self.wait_seconds = 0.0
        self._skipped = 0
        self._epoch_wait_s = self._epoch_wall_s = 0.0
        self._pass_lock = threading.Lock()  # held by the pass under way
        self._pass_thread = ""

    def __repr__(self) -> str:
        c = self.config
        return (f"FeederLoader({c.address!r}, {c.dataset!r}, split={c.split!r}, "
                f"rank={self.rank}, world_size={self.world_size})")

    last_batch = _MovedToConfig()
    augment = _MovedToConfig()
    return_keys = _MovedToConfig()
    return_padding = _MovedToConfig()
    job_id = _MovedToConfig()

    # -- what the daemon has and what is asked for -----------------------------
    @property
    def address(self) -> str:
        """The daemon's address."""
        return self.config.address

    @property
    def dataset(self) -> str:
        """The dataset streamed."""
        return self.config.dataset

    @property
    def split(self) -> str:
        """The split streamed."""
        return self.config.split

    @property
    def seed(self) -> int:
        """Seed of the shuffle plan."""
        return self.config.seed

    @property
    def samples_per_rank(self) -> int:
        """Length of this rank's part of an epoch, in samples."""
        return self._specs.samples_per_rank

    @property
    def batch_size(self) -> int:
        """Samples per batch from the next batch on."""
        return self._sizes.batch_size

    @property
    def image_size(self) -> int:
        """Image side in pixels from the next batch on."""
        return self._sizes.image_size

    @property
    def transport(self) -> str:
        """What carries this loader's pixels: ``shm`` (shared memory with a daemon on
        this host), ``grpc`` (inside the messages) or ``cuda_ipc``; empty before the
        first batch."""
        return self._streams.transport

    @property
    def reconnects(self) -> int:
        """Times a stream was reopened after a transient failure."""
        return self._streams.reconnects

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

    # -- position and sizes --------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; a no-op if already in it (keeps a resumed cursor).

        Raises:
            ConfigError: an epoch the daemon would refuse.
        """
        self._specs.spec(epoch, 0, self._sizes)
        if self.position.move_to_epoch(epoch):
            self._streams.drop()

    def set_batch_size(self, batch_size: int) -> None:
        """Batch size from the next batch on (a stream opened ahead by :meth:`plan_sizes`
        takes over, or the stream reopens at the cursor).

        Raises:
            ConfigError: a batch size refused as at construction.
        """
        self._set_sizes(Sizes(batch_size, self._sizes.image_size, self._sizes.min_scale))

    def set_image_size(self, image_size: int) -> None:
        """Image side from the next batch on (as :meth:`set_batch_size`)."""
        self._set_sizes(Sizes(self._sizes.batch_size, image_size, self._sizes.min_scale))

    def set_min_scale(self, min_scale: float) -> None:
        """RandomResizedCrop minimum area fraction from the next batch on (0: default)."""
        self._set_sizes(Sizes(self._sizes.batch_size, self._sizes.image_size, min_scale))

    def _set_sizes(self, sizes: Sizes) -> None:
        self._specs.check(sizes, self.position.epoch)
        self._sizes = sizes

    def plan_sizes(self, epoch: int, batch_size: int, image_size: int, min_scale: float = 0.0) -> None:
        """Announce that from the start of ``epoch`` on the sizes will be these (a
        schedule's phase change). The stream before it then ends at that epoch, and the
        next one is opened as soon as the daemon has sent the last batch before it, so
        the daemon works on the new phase while the consumer drains the old one. The
        sizes still take effect through ``set_*``; a plan that does not match them
        only costs the stream opened ahead.

        Raises:
            ConfigError: sizes or an epoch refused as at construction.
        """
        sizes = Sizes(batch_size, image_size, min_scale)
        self._specs.check(sizes, epoch)
        self._streams.planned[epoch] = sizes

    def __len__(self) -> int:
        """Batches left in the current epoch for this rank (equal on every rank)."""
        return self._specs.batches_after(self.position.cursor, self._sizes.batch_size)

    # -- resumable state -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Position to resume from: epoch and sample cursor (not a batch index)."""
        return self.position.state_dict() | {"seed": self.seed, "world_size": self.world_size,
                                             "dataset": self.dataset, "split": self.split}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state``: the next batch starts at its cursor.

        Raises:
            ConfigError: The state was saved for another dataset, split, seed or world,
                or holds a position the daemon would refuse.
        """
        for key in ("dataset", "split", "seed", "world_size"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(f"loader state is for {key}={state[key]!r}, "
                                  f"this loader has {getattr(self, key)!r}")
        self._specs.spec(int(state["epoch"]), int(state["cursor"]), self._sizes)
        self.position.load_state_dict(state)
        self._streams.drop()

    # -- iteration -------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        with self._one_pass():
            yield from self._epoch()

    @contextmanager
    def _one_pass(self) -> Iterator[None]:
        """Holds the loader for one pass; a second pass meanwhile would take batches
        of the first one's epoch (and move the position under it)."""
        if not self._pass_lock.acquire(blocking=False):
            raise RuntimeError(f"{self!r} is already being iterated (by thread {self._pass_thread!r}); "
                               f"one pass at a time: finish or close that one, or give each thread its own loader")
        self._pass_thread = threading.current_thread().name
        try:
            yield
        finally:
            self._pass_thread = ""
            self._pass_lock.release()

    def _epoch(self) -> Iterator[tuple[Any, ...]]:
        self._epoch_wait_s = self._epoch_wall_s = 0.0
        started = time.perf_counter()
        while len(self) > 0:
            waited = time.perf_counter()
            host = self._streams.next_batch(self.position.epoch, self.position.cursor, self._sizes)
            if host is None:
                break
            out = self._deliver(host)
            now = time.perf_counter()
            self._account(now - waited, now - started)
            yield out
        self.position.next_epoch()
        self._streams.epoch_ended(self.position.epoch, self._sizes)
        self._epoch_wall_s = time.perf_counter() - started

    def _account(self, wait_s: float, wall_s: float) -> None:
        self.wait_seconds += wait_s
        self._epoch_wait_s += wait_s
        self._epoch_wall_s = wall_s

    def _deliver(self, host: HostBatch) -> tuple[Any, ...]:
        meta = host.meta
        self.position.cursor = meta.cursor
        self._skipped += len(meta.failed_keys)
        if meta.samples_per_rank:
            self._specs.samples_per_rank = meta.samples_per_rank
        images, labels, padding = self._transfer(host.images, host.labels, host.padding, ready=host.ready)
        if not _shares_memory(images, host.images):  # copied out: the slot can go back now
            host.release(self._transfer.copied)
        out: tuple[Any, ...] = (images, labels)
        if self.config.return_keys:
            out += (meta.keys,)
        if self.config.return_padding:
            out += (padding,)
        return out

    def close(self) -> None:
        """Stops prefetching and closes the connection; a second call does nothing.

        A loader that is dropped without ``close()`` is closed when it is
        garbage-collected, or at the latest when the interpreter exits.
        """
        self._release()

    def __enter__(self) -> FeederLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
