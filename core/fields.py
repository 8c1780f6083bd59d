"""What a configuration field says about its command-line option, declared beside
the field as ``dataclasses.field(metadata=cli(...))`` and read by
:mod:`core.options`. Nothing here imports more than the standard library, so every
configuration module may use it.

The naming rule: an option is its field's name with dashes (``--queue-bytes``), a
repeated option the singular of it (``--dataset`` for ``datasets``).

A configuration may group its fields into records: a field whose type is itself a
frozen dataclass (``budgets: Budgets``) is no option, its record's fields are, under
their own names (``--max-streams``), so every option name is unique across a
configuration and its records (:func:`option_fields` checks it).
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

__all__ = ["Cli", "Parse", "cli", "cli_of", "from_options", "option_fields", "option_name", "option_values",
           "records"]

Config = TypeVar("Config")

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


def records(cls: type) -> dict[str, type]:
    """The fields of ``cls`` that are records (their type a dataclass): name -> type."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)  # type: ignore[arg-type]
            if dataclasses.is_dataclass(hints[f.name]) and isinstance(hints[f.name], type)}


def _leaves(cls: type, record: str | None) -> Iterator[tuple[dataclasses.Field, type, str | None]]:
    grouped = records(cls)
    for f in dataclasses.fields(cls):  # type: ignore[arg-type]
        if f.name in grouped:
            yield from _leaves(grouped[f.name], f.name)
        else:
            yield f, cls, record


def option_fields(cls: type) -> list[tuple[dataclasses.Field, type, str | None]]:
    """Every field of ``cls`` and of its records, in order, flat: (the field, the
    class declaring it, the record it is in or None at the top).

    Raises:
        TypeError: two fields of the same name (they would be one option).
    """
    found = list(_leaves(cls, None))
    names = [f.name for f, _, _ in found]
    if len(names) != len(set(names)):
        raise TypeError(f"{cls.__name__}: fields named alike in its records: "
                        f"{sorted({n for n in names if names.count(n) > 1})}")
    return found


def from_options(cls: type[Config], values: Mapping[str, Any]) -> Config:
    """``cls`` built from its options' values by field name, flat (``max_streams=4``
    goes to the record that holds it); fields not given keep their defaults.

    Raises:
        TypeError: a name that is no field of ``cls`` or its records.
    """
    grouped = records(cls)
    top = {name: value for name, value in values.items() if name not in grouped}
    for name, kind in grouped.items():
        mine = {f.name for f, _, _ in option_fields(kind)}
        given = {key: top.pop(key) for key in list(top) if key in mine}
        if name in values and given:
            raise TypeError(f"{cls.__name__}: {name} given with fields of its own: {sorted(given)}")
        top[name] = values[name] if name in values else from_options(kind, given)
    return cls(**top)


def option_values(config: object) -> dict[str, Any]:
    """``config``'s fields and its records' fields, flat: name -> value."""
    found: dict[str, Any] = {}
    for f in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, f.name)
        if f.name in records(type(config)):
            found.update(option_values(value))
        else:
            found[f.name] = value
    return found
