"""The daemon's command, ``feeder serve``. Its options are the fields of
:class:`feeder.config.ServerConfig`, written once there."""

from __future__ import annotations

import typer

from core.options import command_from_config
from feeder.config import ServerConfig, parse_datasets

__all__ = ["parse_datasets", "register", "serve_command"]


def _serve(config: ServerConfig) -> None:
    from feeder.server import serve  # DALI, torch and gRPC's server load only when a daemon starts

    serve(config)


serve_command = command_from_config(
    ServerConfig,
    _serve,
    doc=(
        "Serve decoded, augmented batches of named shard directories over gRPC.\n\n"
        "Example: feeder serve --dataset imagenet=/data/shards --port 50051 --metrics-port 9100\n\n"
        "Open to the network: feeder serve --dataset imagenet=/data/shards --bind 0.0.0.0 "
        "--tls-cert server.pem --tls-key server.key --token-file token\n\n"
        "With a decoded cache: feeder serve --dataset imagenet=/data/shards --decoded-cache-bytes 8G "
        "--decoded-cache-side 256"
    ),
)


def register(app: typer.Typer) -> None:
    """Attach ``feeder serve`` to the CLI."""
    app.command("serve")(serve_command)
