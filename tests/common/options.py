"""Checks that a ``feeder`` command's options are its configuration's fields: the
same names, defaults and help, so that a default changed in the dataclass is changed
on the command line. Used by the tests of each command."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import typer

from cli.app import app
from core.cli import parse_bytes, parse_list
from core.fields import cli_of, option_fields
from core.options import cli_fields, docstring_args, option_help

__all__ = ["assert_options_follow", "command_params"]


def command_params(command: str) -> dict[str, Any]:
    """Parameter name -> the click parameter of ``feeder COMMAND``."""
    group = typer.main.get_command(app)
    return {p.name: p for p in group.commands[command].params}  # type: ignore[attr-defined]


def _expected_name(f: dataclasses.Field) -> str:
    if cli_of(f).argument:
        return f.name
    name = f.name[:-1] if cli_of(f).repeated else f.name
    return "--" + name.replace("_", "-")


def _cli_default(param: Any, f: dataclasses.Field, hint: Any) -> Any:
    """The default the command line gives ``f``, in the field's own terms."""
    sized = (f.name.endswith("_bytes") and hint is int) or cli_of(f).parse is parse_bytes
    if sized and param.default is not None:
        return parse_bytes(param.default, param.opts[0])
    if typing.get_origin(hint) is tuple:
        return parse_list(param.default, param.opts[0])
    return param.default


def assert_options_follow(command: str, cls: type, shown: tuple[str, ...] = ()) -> None:
    """Every field of ``cls`` on the command line is an option (or argument) of
    ``feeder COMMAND`` named after it, with the field's default and its docstring help.

    Args:
        command: the command's name.
        cls: its configuration dataclass.
        shown: extra parameters the command has besides the fields.
    """
    params = command_params(command)
    hints = {f.name: typing.get_type_hints(owner)[f.name] for f, owner, _ in option_fields(cls)}
    documented, helps = docstring_args(cls), option_help(cls)
    fields = cli_fields(cls)
    hidden = {name for name, p in params.items() if getattr(p, "hidden", False)}
    assert set(params) - hidden == {f.name for f in fields} | {"traceback", *shown}
    for f in fields:
        param = params[f.name]
        assert documented.get(f.name), f"{cls.__name__}.{f.name} is not documented"
        assert param.help == helps[f.name]
        if cli_of(f).argument:
            assert param.name == _expected_name(f) and param.required
            continue
        assert param.opts == [_expected_name(f)]
        if f.default_factory is not dataclasses.MISSING:
            assert param.default is None  # left to the dataclass to compute
        elif f.default is dataclasses.MISSING:
            assert param.required
        else:
            assert _cli_default(param, f, hints[f.name]) == f.default, f.name
