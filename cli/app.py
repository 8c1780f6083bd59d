"""The ``feeder`` command line, on top of everything else. Thin: each command builds
a config and calls library code; errors are one line (``--traceback`` for the full
story, see :mod:`core.cli`)."""

from __future__ import annotations

import typer

from core.cli import TRACEBACK_HELP, remember_traceback
from feeder import commands as serve_commands
from launcher import commands as run_commands
from sharder import commands as shard_commands
from trainer import commands as train_commands

__all__ = ["app", "main"]

app = typer.Typer(
    help="feeder: shards, serves and streams image-classification data to training jobs.",
    epilog=(
        "Examples:\n\n"
        "feeder sample-data data/sample\n\n"
        "feeder shard data/sample shards/sample --formats wds,lmdb --workers 2\n\n"
        "feeder verify shards/sample\n\n"
        "feeder serve --dataset sample=shards/sample --port 50051\n\n"
        "torchrun --nproc-per-node 2 -m trainer.train --server 127.0.0.1:50051 "
        "--dataset sample --schedule sample --arch resnet18"
    ),
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


@app.callback()
def _main(ctx: typer.Context,
          traceback: bool = typer.Option(False, "--traceback", help=TRACEBACK_HELP)) -> None:
    remember_traceback(ctx, traceback)


for _module in (shard_commands, serve_commands, run_commands, train_commands):
    _module.register(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
