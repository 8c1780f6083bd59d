"""A command-line command built from a frozen configuration dataclass, so each option
is written once: its name, type and default are the field's, its help is the field's
entry in the class docstring's ``Args:`` section, and validation is the dataclass's
``__post_init__``.

A configuration that groups its fields into records (:func:`core.fields.records`)
has the records' fields as its options, under their own names, and is built from
them with :func:`core.fields.from_options`.

What typer cannot read from the field's type is declared beside the field
(:func:`core.fields.cli`): positional arguments, repeated options, parsers, fields
left off the command line. Two rules need no
declaration: an ``int`` field named ``*_bytes`` takes a size (``8G``, ``512M``, bare
bytes; :func:`core.cli.parse_bytes`) and shows its default as one, and a
``tuple[str, ...]`` field takes a comma list.

Values are parsed when the command runs, so a bad one is one ``feeder: error:`` line
naming the option and exit status 1, like every other configuration error.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Annotated, Any, TypeVar

import typer

from core.cli import (
    TRACEBACK_HELP,
    format_bytes,
    parse_bytes,
    parse_list,
    remember_traceback,
    run_command,
)
from core.fields import Cli, Parse, cli_of, from_options, option_fields, option_name, records

__all__ = ["cli_fields", "command_from_config", "docstring_args", "option_help"]

Config = TypeVar("Config")
_KEYWORD = inspect.Parameter.KEYWORD_ONLY
_QUOTED = re.compile(r"``([^`]+)``")


def _docstring_entries(cls: type) -> dict[str, str]:
    """Field name -> its raw text in the ``Args:`` section of ``cls``'s docstring, or
    of the nearest base class documenting it (a configuration that extends another
    documents only its own fields), or of the record holding it."""
    found: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        found.update(_own_entries(base))
    for kind in records(cls).values():
        found.update(_docstring_entries(kind))
    return found


def _own_entries(cls: type) -> dict[str, str]:
    found: dict[str, str] = {}
    lines = inspect.cleandoc(cls.__dict__.get("__doc__") or "").splitlines()
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
            found[name] = rest.strip()
        elif name is not None:
            found[name] += " " + text
    return found


def docstring_args(cls: type) -> dict[str, str]:
    """Field name -> its description in the ``Args:`` section of ``cls``'s docstring
    (continuation lines joined, ````quotes```` dropped)."""
    return {name: text.replace("``", "") for name, text in _docstring_entries(cls).items()}


def cli_fields(cls: type, exclude: Sequence[str] = ()) -> list[dataclasses.Field]:
    """The fields of ``cls`` (and of its records) offered on the command line, in order."""
    return [f for f, _, _ in _offered(cls, exclude)]


def _offered(cls: type, exclude: Sequence[str]) -> list[tuple[dataclasses.Field, type, str | None]]:
    return [(f, owner, record) for f, owner, record in option_fields(cls)
            if f.init and f.name not in exclude and not cli_of(f).excluded]


def _cli_name(f: dataclasses.Field) -> str:
    return f.name.upper() if cli_of(f).argument else option_name(f)


def option_help(cls: type, exclude: Sequence[str] = ()) -> dict[str, str]:
    """Field name -> its help on the command line: the docstring's description, with
    a quoted field name (````tls_key````) written as its option (``--tls-key``)."""
    names = {f.name: _cli_name(f) for f in cli_fields(cls, exclude)}

    def unquote(match: re.Match[str]) -> str:
        return names.get(match[1], match[1])

    return {name: _QUOTED.sub(unquote, text) for name, text in _docstring_entries(cls).items()}


def _optional(hint: Any) -> Any:
    return typing.Optional[hint]  # noqa: UP007 (built at run time from a type object)


@dataclass(frozen=True)
class _Option:
    """One field of the configuration on the command line."""

    field: dataclasses.Field
    hint: Any
    help: str

    @property
    def spec(self) -> Cli:
        return cli_of(self.field)

    @property
    def flag(self) -> str:
        return option_name(self.field)

    @property
    def computed(self) -> bool:
        """The default is the dataclass's to compute: an option not given is left out."""
        return self.field.default_factory is not dataclasses.MISSING

    def parser(self) -> Parse | None:
        if self.spec.parse is not None:
            return self.spec.parse
        if self.field.name.endswith("_bytes") and self.hint is int:
            return parse_bytes
        if typing.get_origin(self.hint) is tuple:
            return parse_list
        return None

    def _cli_type(self) -> Any:
        if self.spec.repeated:
            return list[str]
        kind = str if self.parser() is not None else self.hint
        return _optional(kind) if self.computed else kind

    def _cli_default(self) -> Any:
        if self.computed:
            return None
        default = self.field.default
        if default is dataclasses.MISSING:
            return inspect.Parameter.empty
        if self.parser() is parse_bytes:
            return format_bytes(default)
        if self.parser() is parse_list:
            return ",".join(default)
        return default

    def _metavar(self) -> str | None:
        if self.spec.metavar is not None:
            return self.spec.metavar
        if self.parser() is parse_bytes:
            return "SIZE"
        return "LIST" if self.parser() is parse_list else None

    def _info(self) -> Any:
        if self.spec.argument:
            return typer.Argument(help=self.help, metavar=self.field.name.upper(), show_default=False)
        # Named only where the name is not typer's own (which gives a flag its --no- twin).
        names = [self.flag] if self.spec.repeated else []
        return typer.Option(*names, help=self.help, metavar=self._metavar())

    def parameter(self) -> inspect.Parameter:
        """The typer parameter of this option."""
        return inspect.Parameter(self.field.name, _KEYWORD, default=self._cli_default(),
                                 annotation=Annotated[self._cli_type(), self._info()])

    def take(self, given: dict[str, Any]) -> tuple[bool, Any]:
        """(whether the field is set, its value), from this option's entry, which is
        removed from ``given``.

        Raises:
            ConfigError: a bad value.
        """
        value = given.pop(self.field.name)
        if value is None and self.computed:
            return False, None
        parse = self.parser()
        return True, value if parse is None else parse(value, self.flag)


def _options(cls: type, exclude: Sequence[str]) -> list[_Option]:
    helps = option_help(cls, exclude)
    return [_Option(f, typing.get_type_hints(owner)[f.name], helps.get(f.name, ""))
            for f, owner, _ in _offered(cls, exclude)]


def _config_values(options: list[_Option], given: dict[str, Any]) -> dict[str, Any]:
    values = {}
    for option in options:
        present, value = option.take(given)
        if present:
            values[option.field.name] = value
    return values


def command_from_config(
    cls: type[Config],
    run: Callable[..., object],
    doc: str,
    exclude: Sequence[str] = (),
    with_context: bool = False,
) -> Callable[..., None]:
    """A typer command whose options are the fields of ``cls`` and of its records (plus
    ``--traceback``); it builds ``cls`` from them (:func:`core.fields.from_options`) and calls ``run`` with it through
    :func:`core.cli.run_command`.

    Args:
        cls: a dataclass whose docstring documents every field under ``Args:``.
        run: what the command does with the built configuration.
        doc: the command's help text.
        exclude: fields not offered on the command line (left at their defaults),
            besides those declared ``cli(excluded=True)``.
        with_context: ``run`` is called with the command's context too,
            ``run(config, ctx)`` (for what a command class put in ``ctx.meta``).
    """
    options = _options(cls, exclude)
    params = [inspect.Parameter("ctx", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=typer.Context)]
    params += [option.parameter() for option in options]
    params.append(inspect.Parameter(
        "traceback", _KEYWORD, default=False,
        annotation=Annotated[bool, typer.Option("--traceback", help=TRACEBACK_HELP)]))

    def command(ctx: typer.Context, **given: Any) -> None:
        remember_traceback(ctx, given.pop("traceback"))
        extra = (ctx,) if with_context else ()
        run_command(ctx, lambda: run(from_options(cls, _config_values(options, given)), *extra))

    command.__signature__ = inspect.Signature(params)  # type: ignore[attr-defined]
    command.__doc__ = doc
    command.__name__ = command.__qualname__ = f"{cls.__name__}_command"
    return command
