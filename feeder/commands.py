"""The daemon's command: ``feeder serve``."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from core.cli import parse_bytes, run_command

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
    threads: Annotated[int | None, typer.Option(
        help="DALI CPU threads of all pipelines together, split evenly among the open streams (at least 1 each; "
        "on a GPU node at least one share per GPU) [default: CPUs, at most 8].")] = None,
    prefetch: Annotated[int, typer.Option(help="Pipeline runs in flight per stream.")] = 2,
    queue_batches: Annotated[int, typer.Option(help="Ready batches buffered per stream.")] = 4,
    queue_bytes: Annotated[str, typer.Option(help="Bytes of ready batches buffered per stream (one batch "
                                                  "always fits). Example: 512M.")] = "256M",
    max_batch_size: Annotated[int, typer.Option(help="Largest batch a client may ask for.")] = 1024,
    max_streams: Annotated[int, typer.Option(help="Streams open at once; more are refused.")] = 64,
    max_streams_per_peer: Annotated[int, typer.Option(help="Streams one client host may hold open (all "
                                                           "unix-socket clients count as one).")] = 32,
    max_memory: Annotated[str | None, typer.Option(help="Memory budget of all streams, each estimated from its "
                                                        "request; past it new streams are refused. Example: 8G.",
                                                   show_default="half of physical memory")] = None,
    idle_timeout_s: Annotated[float, typer.Option(help="Cancel a stream whose client has taken no batch for "
                                                       "this many seconds.")] = 600.0,
    metrics_port: Annotated[int | None, typer.Option(help="Prometheus /metrics port (0: any free one).")] = None,
    grace_s: Annotated[float, typer.Option(help="Seconds in-flight streams get on SIGTERM.")] = 5.0,
    log_level: Annotated[str, typer.Option(help="debug, info (a line per stream opened and closed), "
                                                "warning (errors only) or error.")] = "info",
    antialias: Annotated[bool, typer.Option(
        help="Default resize filter of streams that choose none: antialiased bilinear (torchvision's PIL "
        "path) instead of plain bilinear (tf.data's; about 1.75x the images/s on the CPU).")] = False,
    cpu_decoder: Annotated[str, typer.Option(
        help="What decodes JPEG windows on the CPU: libjpeg-turbo (feeder's window decoder, about 0.6x "
        "DALI's CPU time per window), dali (DALI's ROI decode) or auto (the first where it was built).")]
    = "auto",
    tls_cert: Annotated[Path | None, typer.Option(help="PEM certificate of the gRPC port (TLS only, with "
                                                       "--tls-key).")] = None,
    tls_key: Annotated[Path | None, typer.Option(help="PEM private key of --tls-cert.")] = None,
    tls_client_ca: Annotated[Path | None, typer.Option(help="PEM CA: clients must present a certificate it "
                                                            "signed (mutual TLS).")] = None,
    token_file: Annotated[Path | None, typer.Option(help="File with a token every call but the health check "
                                                         "must send as 'authorization: Bearer <token>'.")] = None,
    insecure: Annotated[bool, typer.Option(help="Allow a non-loopback --bind without TLS and a token.")] = False,
    socket: Annotated[Path | None, typer.Option(help="Also listen on this unix socket (mode 0600) for "
                                                     "clients on this host. Example: /run/feeder.sock.")] = None,
    shm_dir: Annotated[Path, typer.Option(help="tmpfs of the shared-memory rings of clients on this host.")]
    = Path("/dev/shm"),
    ring_slots: Annotated[int, typer.Option(help="Batches a same-host stream may have lent out at once (cover "
                                                 "--queue-batches plus the client's prefetch).")] = 10,
    shm_bytes: Annotated[str, typer.Option(help="Shared memory all rings may take; past it (or with /dev/shm "
                                                "full) streams use the gRPC payload. Example: 16G.")] = "4G",
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

    Open to the network: feeder serve --dataset imagenet=/data/shards --bind 0.0.0.0
    --tls-cert server.pem --tls-key server.key --token-file token
    With a decoded cache: feeder serve --dataset imagenet=/data/shards --decoded-cache-bytes 8G
    --decoded-cache-side 256
    """
    from feeder.config import ServerConfig
    from feeder.server import serve

    def run() -> None:
        extra: dict[str, int] = {} if threads is None else {"threads": threads}
        if max_memory is not None:
            extra["max_memory_bytes"] = parse_bytes(max_memory, "--max-memory")
        config = ServerConfig(
            datasets=parse_datasets(dataset),
            port=port,
            bind=bind,
            device=device,
            prefetch=prefetch,
            queue_batches=queue_batches,
            queue_bytes=parse_bytes(queue_bytes, "--queue-bytes"),
            max_batch_size=max_batch_size,
            max_streams=max_streams,
            max_streams_per_peer=max_streams_per_peer,
            idle_timeout_s=idle_timeout_s,
            metrics_port=metrics_port,
            grace_s=grace_s,
            log_level=log_level,
            antialias=antialias,
            cpu_decoder=cpu_decoder,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls_client_ca=tls_client_ca,
            token_file=token_file,
            insecure=insecure,
            socket_path=socket,
            shm_dir=shm_dir,
            ring_slots=ring_slots,
            shm_budget_bytes=parse_bytes(shm_bytes, "--shm-bytes"),
            on_error=on_error,
            max_pixels=max_pixels,
            max_pipelines=max_pipelines,
            pipeline_idle_s=pipeline_idle_s,
            decoded_cache_bytes=parse_bytes(decoded_cache_bytes, "--decoded-cache-bytes"),
            decoded_cache_side=decoded_cache_side,
            **extra,
        )
        serve(config)

    run_command(ctx, run)


def register(app: typer.Typer) -> None:
    """Attach ``feeder serve`` to the CLI."""
    app.command("serve")(serve_command)
