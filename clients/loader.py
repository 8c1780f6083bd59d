"""``FeederLoader``: batches from a feeder daemon, on the device, ready to train on.

The loader composes the pieces: what it asks for (:mod:`clients.spec`, checked when it
is built), the streams that deliver it (:mod:`clients.streams`), where it is
(:mod:`clients.position`) and the copy to the device (:mod:`clients.transfer`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from prometheus_client import Gauge

from clients.channel import check_address
from clients.config import LoaderConfig, OnePass
from clients.elastic import check_identity, check_state, resume, segments_to
from clients.host_batch import HostBatch, PinnedFields
from clients.idle import IdleShare, StepGaps
from clients.pool import DaemonPool
from clients.position import Position, Positioned
from clients.ranks import gpu_uuid, local_world_size, resolve_device, resolve_rank
from clients.spec import Sizes
from clients.streams import Streams, checked_specs
from clients.transfer import DeviceTransfer
from core.errors import DataError
from protocol.plan import remaining_length
from transport.base import HostIdentity

__all__ = ["DAEMONS_IN_USE", "FeederLoader"]

# In the process's default registry: a training script's own Prometheus endpoint shows it.
DAEMONS_IN_USE = Gauge("feeder_loader_daemons_in_use", "Daemons a FeederLoader draws its batches from now.",
                       ["dataset", "split", "rank"])


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


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
            A mix with a weight that is not a positive finite number, a dataset (or
            its split) no daemon serves, or ``epoch_samples`` below 1.
        ServiceUnavailable: The daemon cannot be reached within ``connect_timeout_s``.
        NotFound: The daemon does not serve ``dataset`` / ``split`` (one dataset).
        Unauthenticated: The daemon wants another token.
    """

    def __init__(
        self,
        dataset: str | Mapping[str, float],
        *,
        address: str | Sequence[str] | None = None,
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
        max_batches_per_epoch: int = 0,
        transport: str = "auto",
        shm_dir: Path | None = None,
        connect_timeout_s: float = 30.0,
        reconnect_timeout_s: float = 60.0,
        stall_timeout_s: float = 120.0,
        token: str | None = None,
        tls_root: str | Path | None = None,
        tls_cert: str | Path | None = None,
        tls_key: str | Path | None = None,
        pool: str = "all",
        pool_stall_timeout_s: float = 1.0,
        epoch_samples: int | None = None,
    ) -> None:
        # First statement: the arguments are LoaderConfig's fields (a test keeps them so).
        config = LoaderConfig(**{name: value for name, value in locals().items() if name != "self"})
        self.config = config
        self.rank, self.world_size = resolve_rank(config.rank, config.world_size)
        config.stream_spec(self.rank, self.world_size, local_world_size(self.world_size))  # refused before connecting
        self.device = resolve_device(config.device)
        self._transfer = DeviceTransfer(self.device, config.normalize, config.channels_last, config.dtype)
        host = HostIdentity.of_this_process(config.shm_path).client_host(gpu_uuid(self.device))
        daemons = DaemonPool(config, config.addresses)
        self._specs = checked_specs(daemons, config, self.rank, self.world_size, host)
        self._pinned = PinnedFields() if self.device.type == "cuda" else None
        self._streams = Streams(daemons, self._specs, config, pin=self._pinned)
        # Runs once: on close(), when the loader is collected, or at interpreter exit.
        self._release = weakref.finalize(self, self._streams.release)
        self.position = Position()
        self._sizes = config.sizes
        # Samples of an epoch (a mix's epoch_samples) and the class names labels index
        # (a mix's: the union of its datasets', in the order given).
        self.num_samples, self.classes = self._specs.epoch_length, self._specs.split.classes
        self.wait_seconds = 0.0
        self._skipped = 0
        self._epoch_wait_s = self._epoch_wall_s = self._epoch_longest_s = 0.0
        self._gaps = StepGaps(self.device)
        self._pass = OnePass()

    def __repr__(self) -> str:
        c = self.config
        return (f"FeederLoader({c.dataset_name!r}, address={c.address!r}, split={c.split!r}, "
                f"rank={self.rank}, world_size={self.world_size})")

    # -- what the daemon has and what is asked for -----------------------------
    @property
    def address(self) -> str:
        """The daemon's address (the pool's, comma-separated)."""
        return ",".join(self.config.addresses)

    @property
    def dataset(self) -> str:
        """The dataset streamed (a mix's: its names joined with ``+``)."""
        return self.config.dataset_name

    @property
    def epoch_counts(self) -> dict[str, int]:
        """Samples each dataset gives an epoch, by name (the mix's weights' shares)."""
        return self._specs.epoch_counts

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
        """Length of this rank's part of the current epoch, in samples (of what was
        left of it, after a resume at another world size)."""
        return self._specs.part_length(self.position.epoch)

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
    def daemons_in_use(self) -> int:
        """Daemons this loader's batches come from now (with a pool; 1 for one daemon,
        0 before the first batch)."""
        return self._streams.daemons_in_use

    def _report_daemons(self) -> None:
        """Keep the gauge of daemons in use (Prometheus' default registry) current."""
        DAEMONS_IN_USE.labels(dataset=self.dataset, split=self.split, rank=str(self.rank)).set(self.daemons_in_use)

    def add_daemon(self, address: str) -> None:
        """Draw batches from ``address`` too, from the next batch on once it answers
        (with the pool's dataset and manifest).

        Raises:
            ConfigError: ``address`` is not an address.
        """
        check_address(address)
        self._streams.pool.add(address)

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

    @property
    def device_idle(self) -> IdleShare:
        """The device's idle time between the steps of the current (or last) epoch and
        its busy time in them (:mod:`clients.idle`): a step runs from the moment a
        batch is handed over until the next is asked for, and the device's idle time
        is what the loader costs it (waiting for data and preparing it). On CUDA it
        is read from events on the consumer's stream once they have completed, never
        with a synchronisation; on the CPU it is wall-clock time."""
        return self._gaps.share()

    @property
    def longest_wait_s(self) -> float:
        """The longest wait for one batch in the current (or last) epoch, past its first
        (which waits on the streams' start too): what a daemon lost costs the loop."""
        return self._epoch_longest_s

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
        left = self._specs.batches_after(self.position.cursor, self._sizes.batch_size, self.position.epoch)
        cap = self.config.max_batches_per_epoch
        if cap:
            batch = self._sizes.batch_size
            left = min(left, max(0, -(-(cap * batch - self.position.cursor) // batch)))
        return left

    # -- resumable state -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's position: epoch and sample cursor (not a batch index), the world
        size and batch size it ran at, and what earlier ranks consumed of the epoch.
        To resume at another world size, save :func:`clients.merge_states` of every
        rank's state (see :mod:`clients.elastic`)."""
        consumed = self._specs.consumed.get(self.position.epoch, ())
        return self.position.state_dict() | self._identity() | {
            "rank": self.rank, "world_size": self.world_size, "batch_size": self._sizes.batch_size,
            "consumed": segments_to(consumed),
        }

    def _identity(self) -> dict[str, Any]:
        """What a state must share with this loader (see :func:`clients.elastic.check_identity`)."""
        base = self._specs.base  # as the daemon plans it: the wire's last-batch policy, the shuffle it decides
        mine: dict[str, Any] = {"dataset": self.dataset, "split": self.split, "seed": self.seed,
                                "manifest_sha256": self._specs.split.manifest_sha256,
                                "epoch_samples": self._specs.epoch_length, "last_batch": base.last_batch.value,
                                "shuffle": base.shuffled, "augment": base.kind.value}
        whole = len(self.config.mix) == 1 and self._specs.epoch_length == self._specs.split.num_samples
        if self.config.mix and not whole:  # a mix of one over its whole split is the plain stream
            mine["mix"] = [[name, weight] for name, weight in self.config.mix]
        return mine

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state``: one rank's ``state_dict()`` (same world size), or
        the job's :func:`clients.merge_states` (any world size and batch size: the rest
        of the epoch is split among this loader's ranks, each sample once).

        Raises:
            ConfigError: the state was saved for another dataset, split, seed,
                manifest or mix (its datasets, weights, epoch length), is another
                rank's or one rank's at another world size, holds a cursor past the
                rank's part or a position the daemon would refuse, or is of the wrong
                shape (one line naming the field).
        """
        check_identity(check_state(state), self._identity())
        at = resume(state, self.rank, self.world_size)
        self._specs.resume_at(at, self._sizes)
        self.position.load_state_dict({"epoch": at.epoch, "cursor": at.cursor})
        self._streams.drop()

    @property
    def epoch_progress(self) -> float:
        """Share of the current epoch the whole job has consumed (0 to 1), counting
        what earlier ranks consumed before a resume at another world size: where a
        learning-rate schedule stands, by samples seen rather than steps."""
        epoch, total = self.position.epoch, self.num_samples
        before = total - remaining_length(total, self._specs.consumed.get(epoch, ()), self._specs.base.last_batch)
        part = self._specs.part_length(epoch)
        done = before + min(self.position.cursor, part) * self.world_size
        whole = before + part * self.world_size
        return done / whole if whole else 0.0

    # -- iteration -------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        with self._pass.held_by(repr(self)):
            yield from self._epoch()

    def _epoch(self) -> Iterator[tuple[Any, ...]]:
        self._epoch_wait_s = self._epoch_wall_s = self._epoch_longest_s = 0.0
        self._gaps.reset()
        started, first = time.perf_counter(), True
        while len(self) > 0:
            if not first:
                self._gaps.ended()  # the step on the batch before is enqueued
            waited = time.perf_counter()
            host = self._streams.next_batch(self.position.epoch, self.position.cursor, self._sizes)
            if host is None:  # the plan's batches of this epoch are all delivered by then
                raise DataError(f"{self!r}: the streams ended with {len(self)} batches of epoch "
                                f"{self.position.epoch} left (cursor {self.position.cursor})")
            out = self._deliver(host)
            self._gaps.started()
            now = time.perf_counter()
            self._account(now - waited, now - started, first)
            first = False
            yield out
        if not first:
            self._gaps.ended()
        self.position.next_epoch()
        self._streams.epoch_ended(self.position.epoch, self._sizes)
        self._epoch_wall_s = time.perf_counter() - started

    def _account(self, wait_s: float, wall_s: float, first: bool) -> None:
        self.wait_seconds += wait_s
        self._epoch_wait_s += wait_s
        self._epoch_wall_s = wall_s
        if not first:  # the first waits on the stream's start as well
            self._epoch_longest_s = max(self._epoch_longest_s, wait_s)

    def _deliver(self, host: HostBatch) -> tuple[Any, ...]:
        meta = host.meta
        self.position.cursor = meta.cursor
        self._skipped += len(meta.failed_keys)
        self._report_daemons()
        images, labels, padding = self._transfer(host.images, host.labels, host.padding, ready=host.ready)
        if not _shares_memory(images, host.images):  # copied out: the slot can go back now
            host.release(self._transfer.copied)
        if self._pinned is not None and host.fields is not None:
            self._pinned.give(host.fields, self._transfer.copied)
        out: tuple[Any, ...] = (images, labels)
        if self.config.return_keys:
            out += (meta.keys,)
        if self.config.return_padding:
            out += (padding.bool(),)
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
