"""Configuration of a feeder daemon, built once by ``feeder serve`` (or a test) and
passed down."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError
from feeder.decoded_cache import check_budget

__all__ = ["DEVICES", "LOG_LEVELS", "ServerConfig"]

DEVICES = ("auto", "cpu", "gpu")
LOG_LEVELS = ("debug", "info", "warning", "error")


def _default_threads() -> int:
    return max(1, min(8, os.cpu_count() or 1))


@dataclass(frozen=True)
class ServerConfig:
    """What a daemon serves and how.

    Args:
        datasets: dataset name -> shard directory (made by ``feeder shard``). Clients
            ask by name; they can never make the daemon open another path.
        port: TCP port to listen on; 0 picks any free port.
        bind: address to bind; loopback by default.
        device: ``auto`` (GPU when CUDA is available), ``cpu`` or ``gpu``.
        threads: DALI CPU worker threads per pipeline.
        prefetch: pipeline runs kept in flight per stream.
        queue_batches: ready batches buffered per stream (backpressure bound).
        max_batch_size: largest batch a request may ask for.
        max_streams: streams open at once; more are refused as unavailable.
        metrics_port: Prometheus HTTP port (0: any free port), None for no endpoint.
        grace_s: on shutdown, seconds in-flight streams get before they are cancelled.
        rpc_threads: gRPC worker threads (each open stream holds one).
        log_level: least severe log records written to stderr (one of ``LOG_LEVELS``).
        antialias: resize filter of streams that do not choose one: plain bilinear
            (False: tf.data's filter; 1.75x the images/s of the antialiased one on 2
            CPU cores at 224 px) or antialiased bilinear (True: torchvision's PIL path).
        decoded_cache_bytes: budget of the decoded cache (decoded images kept in RAM,
            shared by every stream and job; see feeder.decoded_cache); 0, the default,
            turns it off, because cached pixels are downscaled ones. Refused when larger
            than the machine's memory.
        decoded_cache_side: cached images keep their shorter side at most this many
            pixels; streams asking for a larger image_size decode from JPEG (counted).
    """

    datasets: Mapping[str, Path]
    port: int = 50051
    bind: str = "127.0.0.1"
    device: str = "auto"
    threads: int = field(default_factory=_default_threads)
    prefetch: int = 2
    queue_batches: int = 4
    max_batch_size: int = 1024
    max_streams: int = 64
    metrics_port: int | None = None
    grace_s: float = 5.0
    rpc_threads: int = 0
    log_level: str = "info"
    antialias: bool = False
    decoded_cache_bytes: int = 0
    decoded_cache_side: int = 256

    def __post_init__(self) -> None:
        if not self.datasets:
            raise ConfigError("datasets: give at least one NAME=PATH")
        for name in self.datasets:
            if not name or "=" in name or "/" in name:
                raise ConfigError(f"dataset name {name!r}: must be non-empty, without '=' or '/'")
        if self.device not in DEVICES:
            raise ConfigError(f"device: {self.device!r} is not one of {', '.join(DEVICES)}")
        for port_name in ("port", "metrics_port"):
            port = getattr(self, port_name)
            if port is not None and not 0 <= port <= 65535:
                raise ConfigError(f"{port_name}: {port} is not a TCP port (0-65535)")
        for name in ("threads", "prefetch", "queue_batches", "max_batch_size", "max_streams"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.grace_s < 0:
            raise ConfigError(f"grace_s: must be >= 0, got {self.grace_s}")
        if self.log_level not in LOG_LEVELS:
            raise ConfigError(f"log_level: {self.log_level!r} is not one of {', '.join(LOG_LEVELS)}")
        if self.rpc_threads < 0:
            raise ConfigError(f"rpc_threads: must be >= 0, got {self.rpc_threads}")
        self._check_decoded_cache()

    def _check_decoded_cache(self) -> None:
        if self.decoded_cache_bytes < 0:
            raise ConfigError(f"decoded_cache_bytes: must be >= 0 (0: off), got {self.decoded_cache_bytes}")
        if self.decoded_cache_side < 1:
            raise ConfigError(f"decoded_cache_side: must be >= 1 px, got {self.decoded_cache_side}")
        if self.decoded_cache_bytes:
            check_budget(self.decoded_cache_bytes)

    @property
    def worker_threads(self) -> int:
        """gRPC worker threads: ``rpc_threads`` or enough for every stream plus a few
        unary calls (health, stats) while all streams are open."""
        return self.rpc_threads or self.max_streams + 4
