"""Configuration of a feeder daemon, built once by ``feeder serve`` (or a test) and
passed down: where it serves, and its records (:mod:`feeder.config_groups`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from core.bad_input import DEFAULT_MAX_PIXELS, ON_ERROR
from core.errors import ConfigError
from core.fields import cli, from_options, option_values
from decode.augment import Jitter
from feeder.config_groups import (
    Budgets,
    Calls,
    DecodedCacheOptions,
    Decoding,
    GpuDecoding,
    RemoteOptions,
    Security,
    SharedMemory,
    Tuning,
)
from feeder.config_values import (
    BOUNDS,
    DEFAULT_RING_SLOTS,
    LIBRARY_BYTES,
    is_loopback,
    parse_datasets,
    physical_memory_bytes,
)
from protocol.identity import pixel_options

# OpenCV, the JPEG library and torch are imported where used: ``feeder --help`` builds its options from here.

__all__ = [
    "DEFAULT_MAX_PIXELS", "DEVICES", "FAIR_SHARES", "LIBRARY_BYTES", "LOG_LEVELS", "ON_ERROR", "ServerConfig",
    "is_loopback", "parse_datasets", "physical_memory_bytes",
]

DEVICES = ("auto", "cpu", "gpu")
FAIR_SHARES = ("per-job", "per-stream")
LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass(frozen=True)
class ServerConfig:
    """What a daemon serves and how.

    Args:
        datasets: dataset name -> shard directory (made by ``feeder shard``), given
            as NAME=PATH, once per dataset: a local path, or an object store URL
            (s3://bucket/prefix, gs://, az://; credentials from the environment,
            ~/.aws/credentials and config, or instance metadata). Example:
            imagenet=/data/shards. Clients ask by name; they can never make the
            daemon open another path.
        port: TCP port to listen on; 0 picks any free port (printed on start).
        bind: address to bind: loopback by default, 0.0.0.0 for all. Any other than
            a loopback address needs TLS and a token (``tls_cert``, ``tls_key``,
            ``token_file``) or ``insecure``. The metrics endpoint binds here too.
        device: ``auto`` (GPU when CUDA is available), ``cpu`` or ``gpu``.
        metrics_port: Prometheus HTTP port of ``/metrics`` (0: any free port); None,
            the default: no endpoint.
        grace_s: on shutdown (SIGTERM), seconds in-flight streams get before they are
            cancelled.
        log_level: least severe log records written to stderr: ``debug``, ``info`` (a
            line per stream opened and closed), ``warning`` (errors only) or
            ``error``.
        socket_path: also listen on this unix socket, for clients on this host
            (created owner-only, mode 0600; no TLS on it, the token still applies).
            Example: /run/feeder.sock.
        allow_shard_links: directories outside a dataset's root that links under it
            may lead to, comma-separated, e.g. /mnt/disk1,/mnt/disk2 (shards spread
            over disks by links). Every tar is opened beneath its dataset's root or one
            of these; a link leading anywhere else is refused. Default: none.
        verify_on_start: before serving, check every dataset as ``feeder verify``
            does (each tar's, LMDB's and index's size and sha256 against the manifest,
            the indexes against the tar members, a seeded sample of images decoded):
            any problem stops the start with one line naming the file. Off by default,
            so a start reads only manifests and indexes (every served sample is still
            checked against its checksum in the index as it is read); on, a start
            reads every byte once: 4.7-7.9 s (3.2 CPU s) for 865 MB of shards from
            a warm page cache on 2 busy cores, else a disk's or a store's bandwidth.
        tuning: decode threads and what is tuned (:class:`~feeder.config_groups.Tuning`).
        budgets: the limits streams are admitted against (``Budgets``).
        calls: the gRPC calls' and metrics connections' threads and waits (``Calls``).
        decoding: pixels on the CPU, and samples that cannot be served (``Decoding``).
        gpu: a GPU stream's split between the GPU and the CPU (``GpuDecoding``).
        security: TLS and the token (``Security``).
        shm: the shared-memory rings of same-host clients (``SharedMemory``).
        decoded_cache: decoded images kept in RAM (``DecodedCacheOptions``).
        remote: datasets in object stores and their shard cache (``RemoteOptions``).
        jitter: the photometric steps of training samples, each off by default
            (:class:`~decode.augment.Jitter`).
    """

    datasets: Mapping[str, Path | str] = field(metadata=cli(repeated=True, parse=parse_datasets, metavar="NAME=PATH"))
    port: int = 50051
    bind: str = "127.0.0.1"
    device: str = "auto"
    metrics_port: int | None = None
    grace_s: float = 5.0
    log_level: str = "info"
    socket_path: Path | None = None
    allow_shard_links: tuple[str, ...] = ()
    verify_on_start: bool = False
    tuning: Tuning = field(default_factory=Tuning)
    budgets: Budgets = field(default_factory=Budgets)
    calls: Calls = field(default_factory=Calls)
    decoding: Decoding = field(default_factory=Decoding)
    gpu: GpuDecoding = field(default_factory=GpuDecoding)
    security: Security = field(default_factory=Security)
    shm: SharedMemory = field(default_factory=SharedMemory)
    decoded_cache: DecodedCacheOptions = field(default_factory=DecodedCacheOptions)
    remote: RemoteOptions = field(default_factory=RemoteOptions)
    jitter: Jitter = field(default_factory=Jitter)

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("datasets: give at least one NAME=PATH")
        for name in self.datasets:
            if not name or "=" in name or "/" in name:
                raise ConfigError(f"dataset name {name!r}: must be non-empty, without '=' or '/'")
        values = option_values(self)
        for option, allowed in (("device", DEVICES), ("fair_share", FAIR_SHARES), ("log_level", LOG_LEVELS),
                                ("on_error", ON_ERROR)):
            if values[option] not in allowed:
                raise ConfigError(f"{option}: {values[option]!r} is not one of {', '.join(allowed)}")
        for port_name in ("port", "metrics_port"):
            port = values[port_name]
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{port_name}: {port} is not a TCP port (0-65535)")
        for names, holds, rule in BOUNDS:
            for name in names:
                if not holds(values[name]):  # NaN fails each
                    raise ConfigError(f"{name}: must be {rule}, got {values[name]}")
        from decode.registry import check_cpu_decoder  # the decoders' libraries load only when a daemon is configured

        check_cpu_decoder(self.decoding.cpu_decoder)
        for name in ("hw_decoder_load", "cpu_decode_share"):
            value = values[name]
            if value is not None and not 0.0 <= value <= 1.0:
                raise ConfigError(f"{name}: must be in 0..1 (or left out: by GPU model / tuned), got {value}")
        self._check_security()
        self._check_decoded_cache()
        self._check_remote()

    @classmethod
    def of(cls, **options: Any) -> Self:
        """The configuration of these options, by field name, flat as on the command
        line (``ServerConfig.of(datasets=..., threads=2, max_streams=8)``); the records
        left out keep their defaults."""
        return from_options(cls, options)

    def _check_security(self) -> None:
        security = self.security
        if (security.tls_cert is None) != (security.tls_key is None):
            missing = "tls_key" if security.tls_key is None else "tls_cert"
            raise ConfigError(f"{missing}: TLS needs both --tls-cert and --tls-key")
        if security.tls_client_ca is not None and security.tls_cert is None:
            raise ConfigError("tls_client_ca: mutual TLS needs --tls-cert and --tls-key as well")
        protected = security.tls_cert is not None and security.token_file is not None
        if not (is_loopback(self.bind) or protected or security.insecure):
            raise ConfigError(
                f"bind: {self.bind} is not a loopback address; serving it needs --tls-cert, --tls-key and "
                "--token-file (or --insecure to serve it without)"
            )

    def _check_decoded_cache(self) -> None:
        cache = self.decoded_cache
        if cache.decoded_cache_bytes < 0:
            raise ConfigError(f"decoded_cache_bytes: must be >= 0 (0: off), got {cache.decoded_cache_bytes}")
        if cache.decoded_cache_side < 1:
            raise ConfigError(f"decoded_cache_side: must be >= 1 px, got {cache.decoded_cache_side}")
        if cache.decoded_cache_bytes:
            from decode.decoded_cache import check_budget

            check_budget(cache.decoded_cache_bytes, physical_memory_bytes())

    def _check_remote(self) -> None:
        remote = self.remote
        if remote.s3_endpoint is not None and not remote.s3_endpoint.startswith(("http://", "https://")):
            raise ConfigError(f"s3_endpoint: {remote.s3_endpoint!r} is not an http:// or https:// URL")
        if remote.cache_bytes < 0 or remote.cache_fetch_bytes_per_s < 0:
            raise ConfigError("cache_bytes and cache_fetch_bytes_per_s: must be >= 0")
        if remote.cache_dir is not None and remote.cache_dir.exists() and not remote.cache_dir.is_dir():
            raise ConfigError(f"cache_dir: {remote.cache_dir} exists and is not a directory")

    @property
    def remote_datasets(self) -> list[str]:
        """The names of the datasets in object stores."""
        return [name for name, root in self.datasets.items() if isinstance(root, str)]

    @property
    def pixel_options(self) -> dict[str, str]:
        """The options that change a stream's pixels, as ``ListDatasets`` reports them
        (:func:`protocol.identity.pixel_options`)."""
        cache = self.decoded_cache
        side = cache.decoded_cache_side if cache.decoded_cache_bytes else 0
        return pixel_options(self.decoding.antialias, self.decoding.max_pixels, side, self.jitter.pixel_options())

    @property
    def footprint_bytes(self) -> int:
        """The most resident memory the daemon should take: the streams' budget, the
        shared-memory rings', the decoded cache's, and the libraries (``LIBRARY_BYTES``).
        Idle pipelines kept for reuse give their batch buffers back, so they add
        nothing that grows with batch size."""
        return (self.budgets.max_memory_bytes + self.shm.shm_budget_bytes + self.decoded_cache.decoded_cache_bytes
                + LIBRARY_BYTES)

    def stream_ring_slots(self, client_prefetch: int) -> int:
        """Ring slots of a same-host stream whose client keeps ``client_prefetch``
        batches ready (0: it did not say): ``ring_slots``, or what covers the
        daemon's queue, the client's prefetch, the batch it reads and one on the wire."""
        if self.shm.ring_slots:
            return self.shm.ring_slots
        if not client_prefetch:
            return DEFAULT_RING_SLOTS
        return self.budgets.queue_batches + client_prefetch + 2

    @property
    def worker_threads(self) -> int:
        """gRPC worker threads: ``rpc_threads`` or enough for every stream plus a few
        unary calls (health, stats) while all streams are open."""
        return self.calls.rpc_threads or self.budgets.max_streams + 4
