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
    on_error: Annotated[str, typer.Option(
        help="A sample that fails to decode or is over --max-pixels: skip (replace it by a repeat of a good "
        "sample of its batch, marked as padding; counted, named in GetStats and logged) or fail (end the "
        "stream with DATA_LOSS naming it).")] = "skip",
    max_pixels: Annotated[int, typer.Option(
        help="Largest width x height served, as the index says; larger samples are refused unread (see "
        "--on-error). Default: PIL's decompression-bomb threshold.")] = 89_478_485,
    max_pipelines: Annotated[int, typer.Option(
        help="Built pipelines held at once, lent to streams or idle; each open stream holds one, so keep it "
        ">= --max-streams (a stream that finds all lent is refused as unavailable).")] = 64,
    pipeline_idle_s: Annotated[float, typer.Option(
        help="Seconds an idle pipeline is kept for reuse before its threads and buffers are freed.")] = 30.0,
) -> None:
    """Serve decoded, augmented batches of named shard directories over gRPC.

    Example: feeder serve --dataset imagenet=/data/shards --port 50051 --metrics-port 9100
    """
    from feeder.config import ServerConfig
    from feeder.server import serve

    def run() -> None:
        extra: dict[str, int] = {} if threads is None else {"threads": threads}
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
            on_error=on_error,
            max_pixels=max_pixels,
            max_pipelines=max_pipelines,
            pipeline_idle_s=pipeline_idle_s,
            **extra,
        )
        serve(config)

    run_command(ctx, run)


def register(app: typer.Typer) -> None:
    """Attach ``feeder serve`` to the CLI."""
    app.command("serve")(serve_command)
