"""Defaults the documents give for the project's command-line options (`` `--restarts`
(default 5) ``) are the ones its parsers have."""

from __future__ import annotations

import importlib
import re
from collections.abc import Iterator
from pathlib import Path

from tests.docs.commands import console_scripts
from tests.docs.markdown import Problem

__all__ = ["check_defaults", "option_defaults"]

# `--name` or `--name VALUE` in backticks, then within a few words "(default VALUE" or "(default: VALUE".
_STATED = re.compile(r"`(--[a-z][\w-]*)(?:[ =][^`]*)?`[^.;`\n]{0,40}?\(default:? `?"
                     r"(\d[\d,]*\d(?:\.\d+)?(?![\w.])|[^),;`]+)")
_NUMBER = re.compile(r"(\d[\d,]*(?:\.\d+)?)(?: ?s)?")
_SIZE = re.compile(r"(\d+(?:\.\d+)?) ?([KMGT])(?:i?B)?")


def option_defaults(repo: Path) -> dict[str, set[object]]:
    """Every option of the project's typer console scripts, with its defaults (one per
    sub-command that has it)."""
    import typer
    import typer.main

    found: dict[str, set[object]] = {}

    def walk(command: object) -> None:
        for param in getattr(command, "params", []):
            for name in getattr(param, "opts", []):
                found.setdefault(name, set()).add(param.default)
        for sub in getattr(command, "commands", {}).values():
            walk(sub)

    for target in console_scripts(repo / "pyproject.toml").values():
        module, _, attr = target.partition(":")
        app = getattr(importlib.import_module(module), attr)
        if isinstance(app, typer.Typer):
            walk(typer.main.get_command(app))
    return found


def _size(text: str) -> str | None:
    """``4G``, ``4 GiB`` and ``4GB`` alike as ``4G``; None for anything else."""
    size = _SIZE.fullmatch(text.strip())
    return f"{float(size.group(1)):g}{size.group(2)}" if size else None


def _same(stated: str, defaults: set[object]) -> bool | None:
    """Whether a stated default is one of ``defaults``; None when it is not a literal
    this check reads (``half the machine's``, ``tuned``)."""
    if _size(stated):
        return any(_size(str(d)) == _size(stated) for d in defaults)
    number = _NUMBER.fullmatch(stated.strip())
    if number:
        value = float(number.group(1).replace(",", ""))
        return any(isinstance(d, (int, float)) and not isinstance(d, bool) and float(d) == value for d in defaults)
    return None


def check_defaults(document: Path, defaults: dict[str, set[object]],
                   prose: list[tuple[int, str]]) -> Iterator[Problem]:
    """A problem for each stated default that none of the option's parsers has."""
    for number, line in prose:
        for stated in _STATED.finditer(line):
            option, value = stated.group(1), stated.group(2)
            if option in defaults and _same(value, defaults[option]) is False:
                shown = ", ".join(sorted(repr(d) for d in defaults[option]))
                yield Problem(document, number, f"{option}: the document says default {value.strip()}, "
                                                f"the parser has {shown}")
