"""``python -m trainer.train``: the trainer as a standalone command (what torchrun
launches: ``torchrun --nproc-per-node 8 -m trainer.train --server ...``)."""

from __future__ import annotations

import typer

from trainer.commands import train_command

__all__ = ["main"]


def main() -> None:
    """Parses the command line and trains."""
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command()(train_command)
    app()


if __name__ == "__main__":
    main()
