"""The ``feeder`` command line. Thin: each command builds a config and calls library
code; errors are printed as one line (``--traceback`` for the full story)."""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import Any

import typer

from feeder.errors import FeederError, cli_message

app = typer.Typer(
    help="feeder: shards, serves and streams image-classification data to training jobs.",
    epilog=(
        "Examples:\n\n"
        "feeder sample-data data/sample\n\n"
        "feeder shard data/sample shards/sample --format wds,lmdb --workers 2\n\n"
        "feeder verify shards/sample\n\n"
        "feeder serve --dataset sample=shards/sample --port 50051\n\n"
        "torchrun --nproc-per-node 2 -m clients.train --server 127.0.0.1:50051 "
        "--dataset sample --schedule sample --arch resnet18"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_state = {"traceback": False}


@app.callback()
def _main(
    traceback: bool = typer.Option(False, "--traceback", help="Show full tracebacks on errors."),
) -> None:
    _state["traceback"] = traceback


def run_command(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call library code, turning a FeederError into one line on stderr and exit 1."""
    try:
        return fn(*args, **kwargs)
    except FeederError as e:
        if _state["traceback"]:
            raise
        print(cli_message(e), file=sys.stderr)
        raise typer.Exit(1) from e


def _register() -> None:
    # Each area owns the module that defines its commands; they are attached here.
    from clients import commands as train_commands
    from feeder import commands as serve_commands
    from sharder import commands as shard_commands

    for module in (shard_commands, serve_commands, train_commands):
        module.register(app)


_register()


def main() -> None:
    app()


if __name__ == "__main__":
    main()
