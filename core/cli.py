"""How every command turns a :class:`FeederError` into one line on stderr and exit
status 1, with the full traceback only on request (``--traceback``).

The flag lives in typer's context (``ctx.meta``, shared by a command and its parent
group), set by :func:`remember_traceback` from whichever level took the option.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

import typer

from core.errors import ConfigError, FeederError, cli_message

__all__ = [
    "TRACEBACK_HELP", "format_bytes", "parse_bytes", "parse_list", "print_warning", "remember_traceback", "run_command",
]

TRACEBACK_HELP = "Show the full traceback behind an error instead of one line."
_META_KEY = "feeder.traceback"


def remember_traceback(ctx: typer.Context, wanted: bool) -> None:
    """Record ``--traceback`` in ``ctx`` (a group callback or a command calls this with
    the value of its option)."""
    if wanted:
        ctx.meta[_META_KEY] = True


def run_command(ctx: typer.Context, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Call library code; a FeederError becomes one line on stderr and exit 1
    (re-raised whole when ``--traceback`` was given at any level of ``ctx``)."""
    try:
        return fn(*args, **kwargs)
    except FeederError as e:
        if ctx.meta.get(_META_KEY):
            raise
        print(cli_message(e), file=sys.stderr)
        raise typer.Exit(1) from e


def print_warning(text: str) -> None:
    """One ``feeder: warning: ...`` line on stderr."""
    print(f"feeder: warning: {text}", file=sys.stderr)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_bytes(text: str, option: str) -> int:
    """``"8G"`` -> 8 GiB in bytes. Units K, M, G, T are powers of 1024 (``B``, ``iB``
    after them are accepted); a bare number is bytes; 0 is allowed (options where it
    means "off" say so; the others are checked by their configuration).

    Raises:
        ConfigError: not a size (the message names ``option``).
    """
    number = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = number[-1:] if number[-1:] in _UNITS else ""
    try:
        value = float(number[: len(number) - len(unit)]) * _UNITS[unit]
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(f"{option} {text!r}: expected a size such as 8G, 512M or 1073741824")
    return int(value)


def format_bytes(value: int) -> str:
    """``8 << 30`` -> ``"8G"``: the largest unit of :func:`parse_bytes` that divides
    ``value`` exactly (bare bytes otherwise), so that parsing it gives ``value`` back."""
    for unit, size in sorted(_UNITS.items(), key=lambda item: -item[1]):
        if value >= size and value % size == 0:
            return f"{value // size}{unit}"
    return str(value)


def parse_list(text: str, option: str) -> tuple[str, ...]:
    """``"wds, lmdb"`` -> ``("wds", "lmdb")``: a comma list, blanks dropped (the
    configuration checks the words; ``option`` is unused, for the same signature as
    :func:`parse_bytes`)."""
    return tuple(word.strip() for word in text.split(",") if word.strip())
