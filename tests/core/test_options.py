"""core.options: a command built from a dataclass, with every kind of field a
configuration declares (core.fields), and its one-line errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from core.errors import ConfigError
from core.fields import cli, from_options, option_values
from core.options import command_from_config, docstring_args, option_help


def _pairs(values: list[str], option: str) -> dict[str, Path]:
    found = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep:
            raise ConfigError(f"{option} {value!r}: expected NAME=PATH")
        found[name] = Path(path)
    return found


def _doubled() -> int:
    return 2 * 21


@dataclass(frozen=True)
class Example:
    """A configuration with one field of each kind.

    Args:
        out: where to write.
        roots: NAME=PATH, once per root.
        cache_bytes: cache budget; see ``out`` and ``level``.
        formats: comma list.
        level: a plain int.
        width: in units.
        policy: ``skip`` or ``fail``.
        computed: left to the dataclass when not given.
        loud: a flag.
        callback: not on the command line.
    """

    out: Path = field(metadata=cli(argument=True))
    roots: Mapping[str, Path] = field(default_factory=dict, metadata=cli(repeated=True, parse=_pairs))
    cache_bytes: int = 256 << 20
    formats: tuple[str, ...] = ("a",)
    level: int = 3
    width: int = 5
    policy: str = "skip"
    computed: int = field(default_factory=_doubled)
    loud: bool = False
    callback: object = field(default=None, metadata=cli(excluded=True))

    def __post_init__(self) -> None:
        if self.level < 0:
            raise ConfigError(f"--level must be >= 0, got {self.level}")


def _app(seen: list[Example]) -> typer.Typer:
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("run")(command_from_config(Example, seen.append, doc="Run it.\n\nExample: x run out"))
    app.command("other")(lambda: None)
    return app


def _run(*args: str) -> tuple[object, list[Example]]:
    seen: list[Example] = []
    result = CliRunner().invoke(_app(seen), ["run", *args])
    return result, seen


def _ok(*args: str) -> tuple[Example, str]:
    result, seen = _run(*args)
    assert result.exit_code == 0, result.output  # type: ignore[attr-defined]
    return seen[0], result.stderr  # type: ignore[attr-defined]


def test_defaults_are_the_dataclass_defaults() -> None:
    config, stderr = _ok("here")
    assert config == Example(Path("here")) and stderr == ""


def test_each_kind_of_field_is_read() -> None:
    config, _ = _ok("here", "--root", "a=/x", "--root", "b=/y", "--cache-bytes", "1G", "--formats", "a, b",
                    "--level", "4", "--width", "6", "--policy", "fail", "--computed", "7", "--loud")
    assert config.roots == {"a": Path("/x"), "b": Path("/y")} and config.cache_bytes == 1 << 30
    assert config.formats == ("a", "b") and (config.level, config.width, config.policy) == (4, 6, "fail")
    assert config.computed == 7 and config.loud


def test_computed_default_is_left_to_the_dataclass() -> None:
    config, _ = _ok("here")
    assert config.computed == 42


@pytest.mark.parametrize("args,lines", [
    (("--cache-bytes", "12X"), ["feeder: error: --cache-bytes '12X': expected a size such as 8G, 512M or 1073741824"]),
    (("--root", "noequals"), ["feeder: error: --root 'noequals': expected NAME=PATH"]),
    (("--level", "-1"), ["feeder: error: --level must be >= 0, got -1"]),
])
def test_bad_values_are_one_line_and_exit_1(args, lines) -> None:
    result, seen = _run("here", *args)
    assert result.exit_code == 1 and not seen  # type: ignore[attr-defined]
    assert result.stderr.splitlines() == lines  # type: ignore[attr-defined]


def test_excluded_fields_are_not_shown() -> None:
    result = CliRunner().invoke(_app([]), ["run", "--help"], env={"COLUMNS": "200"})
    assert "--callback" not in result.output
    assert "--no-loud" in result.output and "OUT" in result.output and "Example: x run out" in result.output
    assert "256M" in result.output  # a size's default shown as a size


def test_option_help_names_options_where_the_docstring_names_fields() -> None:
    assert docstring_args(Example)["cache_bytes"] == "cache budget; see out and level."
    assert option_help(Example)["cache_bytes"] == "cache budget; see OUT and --level."
    assert option_help(Example)["policy"] == "skip or fail."


def test_every_field_of_the_example_is_documented() -> None:
    documented = docstring_args(Example)
    assert [f.name for f in dataclasses.fields(Example) if f.name not in documented] == []


@dataclass(frozen=True)
class Limits:
    """What it may take.

    Args:
        max_items: at most this many; see ``name``.
    """

    max_items: int = 8


@dataclass(frozen=True)
class Grouped:
    """A configuration with a record.

    Args:
        name: what it is called.
        limits: its limits (a record: its fields are the options).
    """

    name: str = "x"
    limits: Limits = field(default_factory=Limits)


def test_a_records_fields_are_options_of_their_own_names_and_build_the_record() -> None:
    seen: list[Grouped] = []
    app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
    app.command("run")(command_from_config(Grouped, seen.append, doc="Run it."))
    app.command("other")(lambda: None)
    assert CliRunner().invoke(app, ["run", "--max-items", "3", "--name", "y"]).exit_code == 0
    assert seen == [Grouped("y", Limits(3))]
    help_text = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "200"}).output
    assert "--max-items" in help_text and "--limits" not in help_text
    assert option_help(Grouped)["max_items"] == "at most this many; see --name."


def test_a_configuration_is_built_from_its_options_flat_and_read_back_flat() -> None:
    config = from_options(Grouped, {"max_items": 2})
    assert config == Grouped(limits=Limits(2)) and option_values(config) == {"name": "x", "max_items": 2}
    with pytest.raises(TypeError, match="limits given with fields of its own"):
        from_options(Grouped, {"limits": Limits(), "max_items": 2})
