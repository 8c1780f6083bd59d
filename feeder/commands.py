"""The daemon's command: ``feeder serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from core.cli import run_command

__all__ = ["parse_datasets", "register"]


def parse_datasets(values: list[str]) -> dict[str, Path]:
    """``["imagenet=/data/shards", ...]`` -> ``{"imagenet": Path("/data/shards")}``.

    Raises:
        ConfigError: an entry without ``=``, or a name given twice.
    """
    from core.errors import ConfigError

    datasets: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            raise ConfigError(f"--dataset {value!r}: expected NAME=PATH, e.g. imagenet=/data/shards")
        if name in datasets:
            raise ConfigError(f"--dataset {name!r}: given twice")
        datasets[name] = Path(path).expanduser()
    return datasets


def serve_command(
    ctx: typer.Context,
    dataset: Annotated[
        list[str],
        typer.Option(help="NAME=PATH of a shard directory; repeat for more. Example: imagenet=/data/shards."),
    ],
    port: Annotated[int, typer.Option(help="TCP port; 0 picks a free one (printed on start).")] = 50051,
    bind: Annotated[str, typer.Option(help="Address to listen on; loopback by default, 0.0.0.0 for all.")] = "127.0.0.1",
    device: Annotated[str, typer.Option(help="auto (GPU when CUDA is present), cpu or gpu.")] = "auto",
    threads: Annotated[int | None, typer.Option(help="DALI CPU threads per pipeline [default: CPUs, at most 8].")] = None,
    prefetch: Annotated[int, typer.Option(help="Pipeline runs in flight per stream.")] = 2,
    queue_batches: Annotated[int, typer.Option(help="Ready batches buffered per stream.")] = 4,
    max_batch_size: Annotated[int, typer.Option(help="Largest batch a client may ask for.")] = 1024,
    max_streams: Annotated[int, typer.Option(help="Streams open at once; more are refused.")] = 64,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (0: any free one).")] = None,
    grace_s: Annotated[float, typer.Option(help="Seconds in-flight streams get on SIGTERM.")] = 5.0,
    log_level: Annotated[str, typer.Option(help="debug, info (a line per stream opened and closed), "
                                                "warning (errors only) or error.")] = "info",
    antialias: Annotated[bool, typer.Option(
        help="Default resize filter of streams that choose none: antialiased bilinear (torchvision's PIL "
        "path) instead of plain bilinear (tf.data's; about 1.75x the images/s on the CPU).")] = False,
    decoded_cache_bytes: Annotated[str, typer.Option(
        help="Budget of the decoded cache, shared by every stream and job (examples: 8G, 512M); 0 turns it "
        "off. Cached images are downscaled (see --decoded-cache-side), so it changes pixels: off by "
        "default.")] = "0",
    decoded_cache_side: Annotated[int, typer.Option(
        help="Shorter side, px, of the images the decoded cache keeps; streams asking for a larger image "
        "size decode from JPEG.")] = 256,
) -> None:
    """Serve decoded, augmented batches of named shard directories over gRPC.

    Example: feeder serve --dataset imagenet=/data/shards --port 50051 --metrics-port 9100

    With a decoded cache: feeder serve --dataset imagenet=/data/shards --decoded-cache-bytes 8G
    --decoded-cache-side 256
    """
    from feeder.config import ServerConfig
    from feeder.decoded_cache import parse_bytes
    from feeder.server import serve

    def run() -> None:
        extra = {} if threads is None else {"threads": threads}
        config = ServerConfig(
            datasets=parse_datasets(dataset),
            port=port,
            bind=bind,
            device=device,
            prefetch=prefetch,
            queue_batches=queue_batches,
            max_batch_size=max_batch_size,
            max_streams=max_streams,
            metrics_port=metrics_port,
            grace_s=grace_s,
            log_level=log_level,
            antialias=antialias,
            decoded_cache_bytes=parse_bytes(decoded_cache_bytes),
            decoded_cache_side=decoded_cache_side,
            **extra,
        )
        serve(config)

    run_command(ctx, run)


def register(app: typer.Typer) -> None:
    """Attach ``feeder serve`` to the CLI."""
    app.command("serve")(serve_command)
