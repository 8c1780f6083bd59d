"""``feeder run`` (the per-node launcher, :mod:`launcher.run`). Its options are the
fields of :class:`launcher.config.RunConfig`: ``feeder serve``'s, written once in
:class:`feeder.config.ServerConfig`, and the launcher's own."""

from __future__ import annotations

import dataclasses

import typer
from typer.core import TyperCommand

from core.fields import option_name
from core.options import command_from_config
from feeder.config import ServerConfig
from launcher.config import RunConfig

__all__ = ["register", "run_command"]

_COMMAND_KEY = "feeder.run.command"  # ctx.meta: what follows ``--``
_SERVE_ARGS_KEY = "feeder.run.serve_args"  # ctx.meta: the options before it, for feeder serve
# The launcher's own options (and --traceback), left off the daemon's command line.
_OWN = {option_name(f) for f in dataclasses.fields(RunConfig)
        if f.name not in {g.name for g in dataclasses.fields(ServerConfig)}}
_OWN.add("--traceback")


def _serve_args(args: list[str]) -> list[str]:
    """``args`` without the launcher's own options (``--name value`` or ``--name=value``)."""
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in _OWN:
            skip = arg != "--traceback"
        elif arg.split("=", 1)[0] not in _OWN:
            kept.append(arg)
    return kept


class _UntilDashes(TyperCommand):
    """Options up to the first ``--``; what follows is the command, kept whole."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:  # type: ignore[override]
        head, tail = (args[:args.index("--")], args[args.index("--") + 1:]) if "--" in args else (args, [])
        ctx.meta[_COMMAND_KEY], ctx.meta[_SERVE_ARGS_KEY] = tail, _serve_args(head)
        return super().parse_args(ctx, head)


def _run(config: RunConfig, ctx: typer.Context) -> None:
    from launcher.run import NodeLauncher  # gRPC loads only when a launcher runs, not for --help

    status = NodeLauncher(config, ctx.meta[_SERVE_ARGS_KEY], ctx.meta[_COMMAND_KEY]).run()
    raise typer.Exit(status)


run_command = command_from_config(
    RunConfig,
    _run,
    doc=(
        "Run COMMAND (after --) beside this node's daemon: the one already serving on --socket-path "
        "(or --port), else one started with these serve options and waited on until it is healthy. "
        "COMMAND gets FEEDER_ADDRESS and FEEDER_TOKEN; a daemon that dies is started again; when COMMAND "
        "exits, the daemon started for it is stopped, and feeder run exits with COMMAND's status.\n\n"
        "Example: feeder run --dataset imagenet=/data/shards --socket-path /tmp/feeder.sock -- "
        "torchrun --nproc-per-node 8 -m trainer.train --dataset imagenet --schedule imagenet-fastai"
    ),
    with_context=True,
)


def register(app: typer.Typer) -> None:
    """Attach ``feeder run`` to the CLI."""
    app.command("run", cls=_UntilDashes)(run_command)
