"""``FeederLoader``: batches from a feeder daemon, on the device, ready to train on.

The loader composes the pieces: what it asks for (:mod:`clients.spec`, checked when it
is built), the streams that deliver it (:mod:`clients.streams`), where it is
(:mod:`clients.position`), which iteration takes its batches (:mod:`clients.passes`),
the copy to the device (:mod:`clients.transfer`), and what a ``DataLoader`` would
answer (:mod:`clients.dataloader_attrs`, :mod:`clients.dataloader_args`).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from clients.channel import check_address
from clients.config import LoaderConfig
from clients.dataloader_attrs import AsDataLoader
from clients.elastic import check_identity, check_state, resume, segments_to
from clients.host_batch import HostBatch, PinnedFields
from clients.loader_figures import LoaderFigures
from clients.passes import Passes
from clients.pool import DaemonPool
from clients.position import Position, Positioned
from clients.ranks import gpu_uuid, in_process_group, local_world_size, resolve_device, resolve_rank
from clients.spec import Sizes
from clients.streams import Streams, checked_specs
from clients.transfer import DeviceTransfer
from core.errors import DataError
from transport.base import HostIdentity

__all__ = ["FeederLoader"]


def _shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.device == b.device and a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


class FeederLoader(Positioned, LoaderFigures, AsDataLoader):
    """An iterable of ``(images, labels)`` streamed from a feeder daemon, with a
    ``DataLoader``'s contract: ``len()`` is an epoch's batches, each iteration is a
    pass over the epoch the loader stands in, the next epoch's after a pass has handed
    out the last batch (:mod:`clients.passes`); ``dataset``, ``sampler`` and
    DataLoader's arguments answer as a DataLoader's do.

    Images are ``[B, 3, H, W]`` on ``device`` (normalised ``dtype`` or uint8), labels
    int64, prefetched by a background thread. Position is ``(epoch, sample cursor)``.
    Every argument is a field of :class:`LoaderConfig`, same name, type and default,
    documented there. What the daemon would refuse when the first stream opens is
    refused here: each request is checked with the daemon's own checks
    (:mod:`protocol.request`), its message raised as ``ConfigError``.

    Raises:
        ConfigError: An argument out of range or that the daemon would refuse (an
            ``image_size`` or ``min_scale`` out of range, a ``world_size`` over its
            limit, a ``batch_size`` over its ``--max-batch-size`` or, under ``drop``,
            larger than this rank's part), an ``address`` that is not one, a mix's
            weight that is not a positive number, a dataset (or split) no daemon
            serves, ``epoch_samples`` below 1, a DataLoader argument it refuses.
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
        channels_last: bool = False,
        last_batch: str | None = None,
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
        shuffle: bool | None = None,
        sampler: object = None,
        batch_sampler: object = None,
        num_workers: int = 0,
        collate_fn: object = None,
        pin_memory: bool = False,
        drop_last: bool | None = None,
        timeout: float = 0.0,
        worker_init_fn: object = None,
        multiprocessing_context: object = None,
        generator: object = None,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
    ) -> None:
        # First statement: the arguments are LoaderConfig's fields (a test keeps them so).
        config = LoaderConfig(**{name: value for name, value in locals().items() if name != "self"})
        self.config = config
        self.rank, self.world_size = resolve_rank(config.rank, config.world_size)
        config.stream_spec(self.rank, self.world_size, local_world_size(self.world_size))  # refused before connecting
        self.device = resolve_device(config.device)
        LoaderFigures.__init__(self, self.device)
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
        self._passes = Passes()
        # Epoch -> where its pass began after a resume mid-epoch: (cursor, batches handed out before).
        self._resumed: dict[int, tuple[int, int]] = {}
        self._as_dataloader(self.classes, self.num_samples, self._specs.base.shuffled)

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

    # -- position and sizes --------------------------------------------------
    def set_epoch(self, epoch: int) -> None:
        """Moves to the start of ``epoch``; a no-op if already in it (keeps a resumed
        cursor). Not needed between epochs: a pass after the last batch takes the next.

        Raises:
            ConfigError: an epoch the daemon would refuse.
        """
        self._specs.spec(epoch, 0, self._sizes)
        if epoch == self.position.epoch + 1 and self.epoch_done:
            self._next_epoch()  # the one after a finished epoch: what streams ahead is kept
        elif self.position.move_to_epoch(epoch):
            self._streams.drop()
            self._passes.moved((epoch, 0))

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
        """Batches of a whole pass over the current epoch at the current batch size, the
        same before, during and after a pass (equal on every rank but under ``partial``,
        where they may differ by one). After a resume mid-epoch: the batches before the
        checkpoint (at the batch size saved) and those the pass yields (docs/loader.md)."""
        cursor, before = self._resumed.get(self.position.epoch, (0, 0))
        return before + self._batches_from(cursor)

    @property
    def epoch_done(self) -> bool:
        """The current epoch's batches are all handed out (a pass finished it, or a
        state saved at its end was loaded): a next pass takes the following epoch."""
        return self._batches_from(self.position.cursor) == 0

    def _batches_from(self, cursor: int) -> int:
        """Batches of the current epoch from ``cursor`` on."""
        return self._specs.batches_handed(self.position.epoch, cursor, self._sizes.batch_size, self.config)

    # -- resumable state -----------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """This rank's position: epoch and sample cursor (not a batch index), the world
        size and batch size it ran at, and what earlier ranks consumed of the epoch.
        To resume at another world size, save :func:`clients.merge_states` of every
        rank's state (see :mod:`clients.elastic`)."""
        consumed = self._specs.consumed.get(self.position.epoch, ())
        return self.position.state_dict() | self._specs.identity(self.config.mix) | {
            "rank": self.rank, "world_size": self.world_size, "batch_size": self._sizes.batch_size,
            "consumed": segments_to(consumed), "together": in_process_group(self.world_size),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continues from ``state``: one rank's ``state_dict()`` (same world size), or
        the job's :func:`clients.merge_states` (any world size and batch size: the rest
        of the epoch is split among this loader's ranks, each sample once).

        Raises:
            ConfigError: a state saved for another plan (dataset, split, seed, manifest,
                mix), one rank's at another world size, a cursor past the rank's part, a
                position the daemon would refuse, a wrong shape (one line naming the field).
        """
        check_identity(check_state(state), self._specs.identity(self.config.mix))
        at = resume(state, self.rank, self.world_size)
        self._specs.resume_at(at, self._sizes)
        self.position.load_state_dict({"epoch": at.epoch, "cursor": at.cursor})
        self._streams.drop()
        self._passes.moved((at.epoch, at.cursor))
        saved_batch = int(state.get("batch_size") or self._sizes.batch_size)
        self._resumed = {at.epoch: (at.cursor, -(-at.cursor // saved_batch))} if at.cursor else {}

    @property
    def epoch_progress(self) -> float:
        """Share of the current epoch the whole job has consumed (0 to 1), counting
        what earlier ranks consumed before a resume at another world size: where a
        learning-rate schedule stands, by samples seen rather than steps."""
        return self._specs.progress(self.position.epoch, self.position.cursor)

    # -- iteration -------------------------------------------------------------
    def __iter__(self) -> Iterator[tuple[Any, ...]]:
        """A pass over the rest of the current epoch (see :mod:`clients.passes`)."""
        number, back = self._passes.begin((self.position.epoch, self.position.cursor), repr(self))
        if back is not None:
            self.position.load_state_dict({"epoch": back[0], "cursor": back[1]})
            self._streams.drop()
        if self.epoch_done:  # at an epoch's end (a pass took len() batches, or a state saved there)
            self._next_epoch()
        self._pass_began()
        started, handed, done = time.perf_counter(), 0, False
        while not done:
            with self._passes.taking(number, repr(self)):
                if handed:
                    self._gaps.ended()  # the step on the batch before is enqueued
                waited = time.perf_counter()
                out = self._next_batch()
                self._gaps.started()
                now = time.perf_counter()
                self._account(now - waited, now - started, not handed)
                handed += 1
                self._passes.handed()
                done = self.epoch_done
                if done:  # the epoch's last batch: the loader stays at its end until the pass ends
                    self._streams.epoch_ended(self.position.epoch + 1, self._sizes)
                    self._passes.finished((self.position.epoch, self.position.cursor))
            yield out
        if done and self._passes.current(number) and self.epoch_done:  # asked past the last batch
            self._gaps.ended()
            self._next_epoch()
        self._epoch_wall_s = time.perf_counter() - started

    def _next_epoch(self) -> None:
        self.position.next_epoch()
        self._streams.epoch_ended(self.position.epoch, self._sizes)
        self._passes.finished((self.position.epoch, 0))

    def _next_batch(self) -> tuple[Any, ...]:
        """The next batch of the current epoch (one is left) to hand out."""
        epoch, cursor = self.position.epoch, self.position.cursor
        host = self._streams.next_batch(epoch, cursor, self._sizes)
        if host is None:  # the plan's batches of this epoch are all delivered by then
            raise DataError(f"{self!r}: the streams ended with {self._batches_from(cursor)} batches of epoch "
                            f"{epoch} left (cursor {cursor})")
        if self.config.partial:  # the repeats filling the part's end are left out
            host = host.head(self._specs.real_length(epoch) - cursor)
        return self._deliver(host)

    def _deliver(self, host: HostBatch) -> tuple[Any, ...]:
        meta = host.meta
        self.position.cursor = meta.cursor
        self._skipped += len(meta.failed_keys)
        self._streams.report_daemons(self.dataset_name, self.split, self.rank)
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
