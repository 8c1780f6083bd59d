"""A daemon's serve options as text, by option name (``--threads`` -> ``"4"``): what
``ListDatasets`` reports (``serve_options``), and what ``feeder run`` compares with
the options it was given before it shares the daemon already serving on its node
(each side writes its own with :func:`option_texts`, so equal values read equal).

Left out: the datasets (compared by identity, :mod:`protocol.identity`), where the
daemon listens (the launcher found it there), its shared-memory directory (reported
in a field of its own) and the files of its credentials.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from core.cli import format_bytes
from core.fields import option_name, option_values
from core.options import cli_fields
from feeder.config import ServerConfig

__all__ = ["given_fields", "option_texts"]

_UNREPORTED = frozenset({"datasets", "port", "socket_path", "shm_dir", "tls_cert", "tls_key", "tls_client_ca",
                         "token_file"})


def _text(name: str, value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int) and name.endswith("_bytes"):
        return format_bytes(value)
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, tuple):
        return ",".join(str(item) for item in value)
    if isinstance(value, Path):
        return str(value.resolve())
    return str(value)


def _reported() -> list[dataclasses.Field]:
    return [f for f in cli_fields(ServerConfig) if f.name not in _UNREPORTED]


def option_texts(config: ServerConfig) -> dict[str, str]:
    """``config``'s reported options: option name -> its value as text."""
    values = option_values(config)
    return {option_name(f): _text(f.name, values[f.name]) for f in _reported()}


def _names(f: dataclasses.Field) -> set[str]:
    """Every name ``f`` may be given under: its option, and ``--no-`` before a flag."""
    flag = option_name(f)
    found = {flag}
    if f.type in (bool, "bool"):
        found.add("--no-" + flag.removeprefix("--"))
    return found


def given_fields(args: Sequence[str]) -> dict[str, str]:
    """The reported options among ``args`` (``feeder serve`` options as typed):
    field name -> option name, for those given on the command line."""
    typed = {arg.split("=", 1)[0] for arg in args if arg.startswith("--")}
    return {f.name: option_name(f) for f in _reported() if _names(f) & typed}
