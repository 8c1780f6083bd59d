"""What a configuration field says about its command-line option, declared beside
the field as ``dataclasses.field(metadata=cli(...))`` and read by
:mod:`core.options`. Nothing here imports more than the standard library, so every
configuration module may use it.

The naming rule: an option is its field's name with dashes (``--queue-bytes``), a
repeated option the singular of it (``--dataset`` for ``datasets``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["Cli", "Parse", "cli", "cli_of", "option_name"]

_KEY = "cli"

Parse = Callable[[Any, str], Any]  # (text, or list of texts; the option as given) -> field value


@dataclass(frozen=True)
class Cli:
    """How one field appears on the command line (see :func:`cli`)."""

    argument: bool = False
    excluded: bool = False
    parse: Parse | None = None
    repeated: bool = False
    metavar: str | None = None


def cli(
    *,
    argument: bool = False,
    excluded: bool = False,
    parse: Parse | None = None,
    repeated: bool = False,
    metavar: str | None = None,
) -> dict[str, Cli]:
    """Field metadata for its command-line option: ``field(metadata=cli(...))``.

    Args:
        argument: a positional argument (named after the field, upper case).
        excluded: not on the command line (the field keeps its default).
        parse: (text, option) -> value, for values typer cannot read itself.
            ``*_bytes`` integers (sizes such as ``8G``) and ``tuple[str, ...]`` fields
            (comma lists) need none.
        repeated: the option is given once per item (``--dataset a=x --dataset b=y``)
            and ``parse`` receives the list of texts.
        metavar: what the help shows for the value, e.g. ``NAME=PATH``.
    """
    return {_KEY: Cli(argument=argument, excluded=excluded, parse=parse, repeated=repeated, metavar=metavar)}


def cli_of(f: dataclasses.Field) -> Cli:
    """The command-line declaration of ``f`` (the default one when it has none)."""
    found = f.metadata.get(_KEY)
    return found if isinstance(found, Cli) else Cli()


def option_name(f: dataclasses.Field) -> str:
    """``--queue-bytes`` for ``queue_bytes``; ``--dataset`` for a repeated ``datasets``."""
    name = f.name.removesuffix("s") if cli_of(f).repeated else f.name
    return "--" + name.replace("_", "-")
