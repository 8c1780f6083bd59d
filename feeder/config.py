"""Configuration of a feeder daemon, built once by ``feeder serve`` (or a test) and
passed down."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError

__all__ = ["DEFAULT_MAX_PIXELS", "DEVICES", "LOG_LEVELS", "ON_ERROR", "ServerConfig"]

DEVICES = ("auto", "cpu", "gpu")
LOG_LEVELS = ("debug", "info", "warning", "error")
ON_ERROR = ("skip", "fail")
# PIL's own decompression-bomb threshold (``Image.MAX_IMAGE_PIXELS``, 1 GiB / 4 / 3).
DEFAULT_MAX_PIXELS = 89_478_485


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
        on_error: what a stream does with a sample it cannot serve (one that fails to
            decode, or over ``max_pixels``): ``skip`` replaces it by a repeat of a good
            sample of its batch, marked as padding, counts and names it; ``fail`` ends
            the stream with DATA_LOSS naming it.
        max_pixels: largest width x height (as the index says) served; a larger sample
            is refused before it is read or decoded, as ``on_error`` says.
        max_pipelines: built pipelines held at once, lent to streams or idle. Each
            open stream holds one, so a stream that finds all of them lent is refused
            as unavailable; an idle one is dropped, oldest first, to build another.
        pipeline_idle_s: an idle pipeline is dropped after this many seconds, with its
            threads and buffers (DALI keeps its peak buffers while a pipeline lives).
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
    on_error: str = "skip"
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_pipelines: int = 64
    pipeline_idle_s: float = 30.0

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
        if self.on_error not in ON_ERROR:
            raise ConfigError(f"on_error: {self.on_error!r} is not one of {', '.join(ON_ERROR)}")
        for name in ("max_pixels", "max_pipelines"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if not self.pipeline_idle_s > 0:  # NaN too
            raise ConfigError(f"pipeline_idle_s: must be > 0, got {self.pipeline_idle_s}")

    @property
    def worker_threads(self) -> int:
        """gRPC worker threads: ``rpc_threads`` or enough for every stream plus a few
        unary calls (health, stats) while all streams are open."""
        return self.rpc_threads or self.max_streams + 4
