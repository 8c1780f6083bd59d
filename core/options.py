"""A command-line command built from a frozen configuration dataclass, so each option
is written once: its name, type and default are the field's, its help is the field's
entry in the class docstring's ``Args:`` section, and validation is the dataclass's
``__post_init__``."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Callable, Sequence
from typing import Annotated, Any, TypeVar

import typer

from core.cli import TRACEBACK_HELP, remember_traceback, run_command

__all__ = ["command_from_config", "docstring_args"]

Config = TypeVar("Config")


def docstring_args(cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Args:`` section of ``cls``'s docstring
    (continuation lines joined)."""
    found: dict[str, str] = {}
    lines = inspect.cleandoc(cls.__doc__ or "").splitlines()
    if "Args:" not in lines:
        return found
    name = None
    for line in lines[lines.index("Args:") + 1:]:
        if not line.strip():
            break
        text = line.strip()
        head, sep, rest = text.partition(": ")
        if line.startswith("    ") and not line.startswith("     ") and sep and head.isidentifier():
            name = head
            found[name] = rest.strip().replace("``", "")
        elif name is not None:
            found[name] += " " + text.replace("``", "")
    return found


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return inspect.Parameter.empty


def command_from_config(
    cls: type[Config],
    run: Callable[[Config], object],
    doc: str,
    exclude: Sequence[str] = (),
) -> Callable[..., None]:
    """A typer command whose options are the fields of ``cls`` (plus ``--traceback``);
    it builds ``cls(**options)`` and calls ``run`` with it through
    :func:`core.cli.run_command`.

    Args:
        cls: a dataclass whose docstring documents every field under ``Args:``.
        run: what the command does with the built configuration.
        doc: the command's help text.
        exclude: fields not offered on the command line (left at their defaults).
    """
    hints = typing.get_type_hints(cls)
    helps = docstring_args(cls)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in exclude or not f.init:
            continue
        option = typer.Option(help=helps.get(f.name, ""))
        params.append(inspect.Parameter(f.name, inspect.Parameter.KEYWORD_ONLY, default=_default(f),
                                        annotation=Annotated[hints[f.name], option]))
    params.append(inspect.Parameter(
        "traceback", inspect.Parameter.KEYWORD_ONLY, default=False,
        annotation=Annotated[bool, typer.Option("--traceback", help=TRACEBACK_HELP)]))

    def command(ctx: typer.Context, **options: Any) -> None:
        remember_traceback(ctx, options.pop("traceback"))
        run_command(ctx, lambda: run(cls(**options)))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = doc
    command.__name__ = command.__qualname__ = f"{cls.__name__}_command"
    return command
