"""``LoaderConfig``: everything a ``FeederLoader`` is built with, checked once; what
it asks the daemon for is checked with the daemon's own checks (:mod:`clients.spec`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from numbers import Integral, Real
from pathlib import Path

import torch

from clients.channel import check_address, check_token, resolve_address, resolve_shm_dir
from clients.dataloader_args import take_dataloader_arguments
from clients.spec import Sizes, make_spec
from core.errors import ConfigError
from protocol.plan import LastBatch
from protocol.request import AugmentKind, ClientHost, MixPart, StreamSpec, mix_name
from transport.base import TransportKind

__all__ = ["AUGMENTS", "LAST_BATCHES", "POOL_MODES", "TRANSPORTS", "LoaderConfig"]

# The plan's policies, and "partial": the plan's "pad" with the repeats left out here,
# so the last batch is short and every sample comes once.
LAST_BATCHES = (*(policy.value for policy in LastBatch), "partial")
AUGMENTS = ("auto", *(kind.value for kind in AugmentKind))
# The transports a loader may ask for (``auto``: CUDA IPC for a consumer on the
# daemon's GPU, else shared memory on the daemon's host, else gRPC).
TRANSPORTS = tuple(kind.name.lower() for kind in (
    TransportKind.AUTO, TransportKind.SHM, TransportKind.GRPC, TransportKind.CUDA_IPC))


POOL_MODES = ("all", "as-needed")


def _choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"{name}: {value!r} is not one of {', '.join(choices)}")


def _mix(dataset: str | Mapping[str, float], epoch_samples: int | None) -> tuple[tuple[str, float], ...]:
    """The datasets and weights of a mix (empty: one dataset streamed on its own).

    Raises:
        ConfigError: not a name or a mapping of names to weights, a weight that is
            not a positive finite real number (numpy's too, not a bool),
            ``epoch_samples`` below 1.
    """
    if epoch_samples is not None and (isinstance(epoch_samples, bool) or not isinstance(epoch_samples, Integral)
                                      or epoch_samples < 1):
        raise ConfigError(f"epoch_samples: must be an integer of 1 or more, got {epoch_samples!r}")
    if isinstance(dataset, str):
        return ((dataset, 1.0),) if epoch_samples is not None else ()
    if not isinstance(dataset, Mapping) or not dataset:
        raise ConfigError(f"dataset: expected a name or a mapping of names to weights, got {dataset!r:.80}")
    for name, weight in dataset.items():
        if not isinstance(name, str) or not name:
            raise ConfigError(f"dataset: {name!r:.80} is not a dataset name")
        if isinstance(weight, bool) or not isinstance(weight, Real) or not (
                math.isfinite(weight) and weight > 0):
            raise ConfigError(f"dataset: the weight of {name!r} is {weight!r}, not a positive finite number")
    if len(dataset) == 1 and epoch_samples is None:
        return ()  # a mix of one over its whole split: the dataset's plain stream
    return tuple((name, float(weight)) for name, weight in dataset.items())


@dataclass(frozen=True)
class LoaderConfig:
    """Everything a ``FeederLoader`` is built with (its arguments, same names, types
    and defaults), checked once here.

    Args:
        dataset: Name of a dataset the daemon serves, or a mix of several: a mapping
            of their names to positive weights (``{"imagenet": 0.8, "extra": 0.2}``),
            each dataset read in its own sequence of passes and giving its weight's
            share of every epoch and of every batch (docs/loader.md). Labels then
            index the union of their class names in the order given (``classes``)
            and keys are ``NAME/key``.
        address: ``host:port`` of the daemon, ``[v6]:port``, ``dns:///host:port``, or
            ``unix:/path`` of its socket; or a pool of daemons (on other hosts too)
            serving the same dataset, as a list or comma-separated, the one on this
            host first (a host name with several addresses counts as a pool); None
            or empty: the ``FEEDER_ADDRESS`` environment variable (``feeder run``
            sets it).
        split: Split of the dataset (``train``, ``val``).
        batch_size: Samples per batch, per rank.
        image_size: Side of the square output images, pixels.
        seed: Seed of the shuffle plan (the same on every rank).
        rank: This rank; None: from torch.distributed or torchrun's ``RANK``.
        world_size: Ranks in the job; None: as for ``rank``.
        device: Where the tensors go (``"cuda"`` means the current CUDA device).
        normalize: Convert to ``dtype`` with the ImageNet mean/std, else keep uint8.
        channels_last: NHWC memory layout behind the NCHW shape (faster convolutions
            for a model converted with ``model.to(memory_format=torch.channels_last)``;
            a model left contiguous under DDP would warn about its gradients' strides).
        last_batch: ``"drop"`` (equal full batches on every rank), ``"pad"`` (every
            sample once; the last batch is filled with repeats, see ``return_padding``)
            or ``"partial"`` (every sample once; the last batch is short, and ranks'
            batch counts may differ by one). None: ``drop_last``'s, else ``"drop"``
            for the ``train`` split and ``"partial"`` for the others.
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
        max_batches_per_epoch: End each epoch after this many batches (benchmarks;
            0: whole epochs). The streams ask for only those, so the next epoch's
            stream opens while the cut one drains, as at a planned size change.
        transport: How pixels come from a daemon on this host: ``"auto"`` (CUDA IPC
            for batches made on this process's GPU, else shared memory when this
            process can share the daemon's ``/dev/shm``, else inside the gRPC
            messages, with one log line saying why), ``"cuda_ipc"``, ``"shm"`` (host
            shared memory, also for a CUDA consumer) or ``"grpc"``. Where the one
            asked for does not work, the next one down is used, with one warning
            per step down.
            ``loader.transport`` says which one is in use.
        shm_dir: The shared-memory directory (the daemon's ``--shm-dir``); None: the
            ``FEEDER_SHM_DIR`` environment variable (``feeder run`` sets it to its
            daemon's), else ``/dev/shm``.
        connect_timeout_s: How long the first contact may take.
        reconnect_timeout_s: How long to keep reconnecting after the daemon goes away
            (or stalls, or refuses for a budget), counted from the first failure in a
            row; then ``ServiceUnavailable`` (``ResourceExhausted`` with the daemon's
            message if it kept refusing) names the daemon, dataset, split, rank and
            cursor.
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
        pool: With several daemons: ``"all"`` draws batches from every daemon that
            answers; ``"as-needed"`` starts on the first and adds the next while the
            loop waits for data more than 2 % of its time (and drops one below 0.5 %).
        pool_stall_timeout_s: With several daemons: a daemon whose stream sends
            nothing for this long while its batch is due is left for the others (and
            tried again later); one whose stream breaks or is refused, at once. A
            stream's first batch, which may wait for the daemon to build a pipeline,
            gets at least 5 s. 1 s keeps the loop's longest wait through a daemon
            stopped in a pool of three under 2 s (docs/reliability.md).
        epoch_samples: Samples per epoch of a mix (None: the sum of its datasets'
            splits); each dataset gives its weight's share of them (largest
            remainders). Given with one dataset, that dataset's passes are cut into
            epochs of this length.
        shuffle: The order of each epoch: a permutation drawn from ``seed`` and the
            epoch (True) or the stored order (False); None: shuffled for the
            ``train`` split only.

    The rest are ``torch.utils.data.DataLoader``'s own arguments, so that a
    ``DataLoader(...)`` statement keeps its arguments when it becomes a
    ``FeederLoader(...)`` (:mod:`clients.dataloader_args` says what each does here):
    ``drop_last`` sets ``last_batch``; a stock ``sampler`` gives its shuffle and is
    otherwise ignored, like ``num_workers``, ``pin_memory``, ``timeout``,
    ``multiprocessing_context``, ``generator``, ``prefetch_factor``,
    ``persistent_workers``, ``pin_memory_device`` and ``in_order`` (one warning each
    where not DataLoader's default); ``batch_sampler``, ``collate_fn`` and
    ``worker_init_fn`` are refused.

    Raises:
        ConfigError: A value that cannot work, or that the daemon would refuse in a
            request (then with the daemon's message); the message starts with the
            field's name.
    """

    dataset: str | Mapping[str, float]
    address: str | Sequence[str] | None = None
    split: str = "train"
    batch_size: int = 256
    image_size: int = 224
    seed: int = 0
    rank: int | None = None
    world_size: int | None = None
    device: str | torch.device = "cpu"
    normalize: bool = True
    channels_last: bool = False
    last_batch: str | None = None
    return_keys: bool = False
    return_padding: bool = False
    dtype: torch.dtype = torch.float32
    augment: str = "auto"
    min_scale: float = 0.0
    job_id: str = ""
    prefetch_batches: int = 4
    prefetch_next_epoch: bool = True
    max_batches_per_epoch: int = 0
    transport: str = "auto"
    shm_dir: Path | None = None
    connect_timeout_s: float = 30.0
    reconnect_timeout_s: float = 60.0
    stall_timeout_s: float = 120.0
    token: str | None = field(default=None, repr=False)  # never in logs
    tls_root: str | Path | None = None
    tls_cert: str | Path | None = None
    tls_key: str | Path | None = None
    pool: str = "all"
    pool_stall_timeout_s: float = 1.0
    epoch_samples: int | None = None
    shuffle: bool | None = None
    sampler: object = None
    batch_sampler: object = None
    num_workers: int = 0
    collate_fn: object = None
    pin_memory: bool = False
    drop_last: bool | None = None
    timeout: float = 0.0
    worker_init_fn: object = None
    multiprocessing_context: object = None
    generator: object = None
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pin_memory_device: str = ""
    in_order: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.epoch_samples, Integral) and not isinstance(self.epoch_samples, bool):
            object.__setattr__(self, "epoch_samples", int(self.epoch_samples))  # numpy's too
        taken = take_dataloader_arguments(vars(self), self.split)
        object.__setattr__(self, "shuffle", taken.shuffle)
        object.__setattr__(self, "last_batch", taken.last_batch)
        object.__setattr__(self, "address", resolve_address(self.address))
        object.__setattr__(self, "shm_dir", resolve_shm_dir(self.shm_dir))
        _mix(self.dataset, self.epoch_samples)
        for address in self.addresses or ("",):  # no address at all: refused as an empty one
            check_address(address)
        _choice("pool", self.pool, POOL_MODES)
        _choice("last_batch", self.last_batch or "", LAST_BATCHES)
        _choice("augment", self.augment, AUGMENTS)
        _choice("transport", self.transport, TRANSPORTS)
        if self.prefetch_batches < 1:
            raise ConfigError(f"prefetch_batches: must be >= 1, got {self.prefetch_batches}")
        if self.max_batches_per_epoch < 0:
            raise ConfigError(f"max_batches_per_epoch: must be >= 0 (0: whole epochs), got "
                              f"{self.max_batches_per_epoch}")
        for name in ("connect_timeout_s", "reconnect_timeout_s", "stall_timeout_s", "pool_stall_timeout_s"):
            if not getattr(self, name) > 0:  # NaN too
                raise ConfigError(f"{name}: must be positive, got {getattr(self, name)}")
        if self.token is not None:
            check_token(self.token)
        if (self.tls_cert is None) != (self.tls_key is None):
            raise ConfigError("tls_cert and tls_key: give both or neither")
        if self.tls_cert is not None and self.tls_root is None:
            raise ConfigError("tls_root: a client certificate needs TLS (give the daemon's CA as tls_root)")
        # What the daemon would refuse; rank and world_size may be known only when the
        # loader is built (then checked again), and these stand-ins refuse nothing.
        rank = 0 if self.rank is None else self.rank
        self.stream_spec(rank, rank + 1 if self.world_size is None else self.world_size)

    @property
    def shm_path(self) -> Path:
        """The shared-memory directory, resolved (``shm_dir``, ``FEEDER_SHM_DIR``, ``/dev/shm``)."""
        return resolve_shm_dir(self.shm_dir)

    @property
    def addresses(self) -> tuple[str, ...]:
        """The daemons, in the order given (``address`` split at commas)."""
        given = [self.address] if isinstance(self.address, str) else list(self.address or ())
        return tuple(part.strip() for entry in given for part in str(entry).split(",") if part.strip())

    @property
    def mix(self) -> tuple[tuple[str, float], ...]:
        """The mix's datasets and weights, in the order given (empty: one dataset)."""
        return _mix(self.dataset, self.epoch_samples)

    @property
    def datasets(self) -> tuple[str, ...]:
        """The datasets streamed, in the order given."""
        return tuple(name for name, _ in self.mix) if self.mix else (self.dataset_name,)

    @property
    def dataset_name(self) -> str:
        """The dataset's name, or the mix's (its names joined with ``+``)."""
        if isinstance(self.dataset, str):
            return self.dataset
        return "+".join(self.dataset)

    @property
    def sizes(self) -> Sizes:
        """The first stream's sizes."""
        return Sizes(self.batch_size, self.image_size, self.min_scale)

    def stream_spec(self, rank: int, world_size: int, local_world_size: int = 0,
                    epoch_samples: int | None = None, client_host: ClientHost | None = None) -> StreamSpec:
        """What this loader's streams ask for (each sets its own epoch, cursor, epoch
        count and sizes), as the daemon reads it. A mix's epoch length is
        ``epoch_samples`` where given (the daemons' sizes known), else the configured
        one (1 standing in where it is not known yet); ``client_host``: where this
        process runs (None before it is known).

        Raises:
            ConfigError: what the daemon would refuse, with its message.
        """
        mix = tuple(MixPart(name, weight) for name, weight in self.mix)
        length = (epoch_samples or self.epoch_samples or 1) if mix else 0
        return make_spec(self.sizes, dataset=mix_name(mix) if mix else self.dataset_name, split=self.split,
                         rank=rank, world_size=world_size, seed=self.seed, last_batch=self.last_batch_policy,
                         augment=self.augment_kind, job_id=self.job_id, local_world_size=local_world_size,
                         mix=mix, epoch_samples=length, transport=self.transport_kind.value,
                         client_host=client_host, prefetch_batches=self.prefetch_batches, shuffle=self.shuffle)

    @property
    def last_batch_policy(self) -> LastBatch:
        """``last_batch`` as the plan's policy (``partial`` is ``pad``'s plan)."""
        return LastBatch.PAD if self.last_batch == "partial" else LastBatch(self.last_batch)

    @property
    def partial(self) -> bool:
        """Whether the repeats that fill a last batch are left out (``last_batch="partial"``)."""
        return self.last_batch == "partial"

    @property
    def augment_kind(self) -> AugmentKind | None:
        """``augment`` as the request's kind (None: the split's default)."""
        return None if self.augment == "auto" else AugmentKind(self.augment)

    @property
    def transport_kind(self) -> TransportKind:
        """``transport`` as the request's kind."""
        return TransportKind[self.transport.upper()]

