"""Commands in the documents parse: ``make TARGET`` against the Makefile, the project's
console scripts and ``python -m MODULE`` / ``torchrun -m MODULE`` / ``python SCRIPT.py``
through their own typer or argparse parsers, stopped once the parse succeeds."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import re
import runpy
import shlex
import sys
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path

from tests.docs.markdown import SHELL_LANGUAGES, Block, Problem
from tests.docs.references import find_spec

__all__ = ["CommandChecker", "check_commands", "console_scripts"]

_PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
# Programs that run another command given after their own options.
_WRAPPERS = {"srun", "nice", "exec", "env", "time", "nohup", "sudo"}
# What a span of prose may leave out when it names a command (`feeder serve`, `--cache-dir`).
_INCOMPLETE = re.compile(r"Missing (?:argument|option|parameter)|requires an argument|expected one argument|"
                         r"the following arguments are required")


class _Parsed(Exception):
    """Raised once a command line has been parsed: nothing after the parse runs."""


def _commands(blocks: list[Block], prose: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Each command of the shell blocks (continuation lines joined, ``$ `` prompts and
    comments dropped), and inline ``make``/``python``/``feeder`` spans of the prose."""
    for block in blocks:
        if block.language not in SHELL_LANGUAGES:
            continue
        pending, start = "", 0
        for i, line in enumerate(block.lines):
            if not pending:
                start = block.first_line + i
            text = re.sub(r"^\s*\$\s+", "", line) if not pending else line
            if text.rstrip().endswith("\\"):
                pending += text.rstrip()[:-1] + " "
                continue
            command, pending = pending + text, ""
            if command.strip() and not command.lstrip().startswith("#"):
                yield start, command
    for number, line in prose:
        for span in re.finditer(r"`([^`]+)`", line):
            text = span.group(1)
            first = text.split(" ", 1)[0]
            if (first in {"make", "feeder", "torchrun"} or _PYTHONS.match(first)) and " " in text.strip():
                yield -number, text  # negative: a span in prose, which may name a command without its arguments


def _words(command: str) -> list[list[str]] | None:
    """The simple commands of a line (split at ``&&``, ``||``, ``;``, ``|``), or None when
    it has placeholders (``...``, ``[optional]``, ``<name>``) or is not shell."""
    try:
        lexer = shlex.shlex(command, posix=True, punctuation_chars=";&|")
        lexer.whitespace_split = True
        lexer.commenters = "#"
        tokens = list(lexer)
    except ValueError:
        return None
    parts: list[list[str]] = [[]]
    for token in tokens:
        if token in {"&&", "||", ";", "|", "&"}:
            parts.append([])
        elif token in {">", ">>", "2>", "<"}:
            parts[-1].append("\0redirect")
        else:
            parts[-1].append(token)
    result = []
    for part in parts:
        part = _drop_redirects(part)
        while part and re.match(r"^[A-Za-z_][A-Za-z0-9_]*=", part[0]):
            part = part[1:]
        if part:
            result.append(part)
    return result


def _drop_redirects(tokens: list[str]) -> list[str]:
    kept, skip = [], False
    for token in tokens:
        if skip:
            skip = False
        elif token == "\0redirect":
            skip = True
        elif not re.match(r"^\d?>", token):
            kept.append(token)
    return kept


def _has_placeholder(argv: list[str]) -> bool:
    return any("..." in t or "<" in t or t.startswith("[") or t.endswith("]") or re.fullmatch(r"[A-Z][A-Z_]+", t)
               or "$" in t for t in argv)


class CommandChecker:
    """Parses command lines with the project's own parsers, stopping each after its parse."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.targets = _make_targets(repo / "Makefile")
        self.scripts = console_scripts(repo / "pyproject.toml")

    def check(self, argv: list[str]) -> str | None:
        """None when ``argv`` parses, else why not."""
        program = argv[0]
        if program == "make":
            return self._make(argv[1:])
        if program in _WRAPPERS:
            rest = [i for i, t in enumerate(argv[1:], 1) if self._known(t)]
            return self.check(argv[rest[0]:]) if rest else None
        if program in self.scripts:
            return self._console(program, argv[1:])
        if _PYTHONS.match(program):
            return self._python(argv[1:])
        if program == "torchrun":
            return self._torchrun(argv[1:])
        if program == "pytest":
            return self._paths(argv[1:])
        return None

    def _known(self, token: str) -> bool:
        return token in {"make", "torchrun", "pytest"} or token in self.scripts or bool(_PYTHONS.match(token))

    def _make(self, args: list[str]) -> str | None:
        for arg in args:
            if not arg.startswith("-") and "=" not in arg and arg not in self.targets:
                return f"make has no target {arg!r}"
        return None

    def _console(self, name: str, args: list[str]) -> str | None:
        module, _, attr = self.scripts[name].partition(":")
        if _has_placeholder(args[:1]):
            return None
        return self._parse(lambda: _call(importlib.import_module(module), attr), [name, *args])

    def _python(self, args: list[str]) -> str | None:
        if args[:1] == ["-m"] and len(args) > 1:
            module = args[1]
            if find_spec(module) is None:
                return f"no module {module!r}"
            if module == "pytest":
                return self._paths(args[2:])
            if not _is_project_module(self.repo, module):
                return None
            return self._parse(lambda: runpy.run_module(module, run_name="__main__", alter_sys=True),
                               [module, *args[2:]])
        if args and args[0].endswith(".py"):
            script = self.repo / args[0]
            if not script.is_file():
                return f"no such script: {args[0]}"
            return self._parse(lambda: runpy.run_path(str(script), run_name="__main__"), [str(script), *args[1:]])
        return None

    def _torchrun(self, args: list[str]) -> str | None:
        if "-m" in args:
            return self._python(args[args.index("-m"):])
        scripts = [i for i, a in enumerate(args) if a.endswith(".py")]
        return self._python(args[scripts[0]:]) if scripts else None

    def _paths(self, args: list[str]) -> str | None:
        for arg in args:
            path = arg.split("::", 1)[0]
            if not arg.startswith("-") and "/" in path and "..." not in path and not (self.repo / path).exists():
                return f"no such test path: {path}"
        return None

    def _parse(self, run: object, argv: list[str]) -> str | None:
        """Runs ``run`` with ``sys.argv = argv`` until its first parse of the command line
        (argparse or typer) ends: None if the parse succeeded, else its message."""
        tail: list[str] = []
        if "--" in argv:  # `feeder run [options] -- COMMAND`: COMMAND is checked on its own
            tail = argv[argv.index("--") + 1:]
            argv = argv[:argv.index("--")]
        err = io.StringIO()
        with _parse_only(), contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()), \
                _argv(argv), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy's, about a module imported before
            try:
                run()  # type: ignore[operator]
            except _Parsed:
                return self.check(tail) if tail else None
            except SystemExit as e:
                if e.code in (0, None):
                    return None
                said = (err.getvalue().strip().splitlines() or [f"exit status {e.code}"])[-1]
                return f"does not parse: {_shown(argv)}: {said}"
            except _ParseError as e:
                return f"does not parse: {_shown(argv)}: {e}"
        return f"{argv[0]} ran to its end without parsing a command line"


def _shown(argv: list[str]) -> str:
    return " ".join([Path(argv[0]).name, *argv[1:]])


class _ParseError(Exception):
    pass


def _call(module: object, attr: str) -> None:
    target = getattr(module, attr)
    target()


@contextlib.contextmanager
def _argv(argv: list[str]) -> Iterator[None]:
    saved = sys.argv
    sys.argv = list(argv)
    try:
        yield
    finally:
        sys.argv = saved


@contextlib.contextmanager
def _parse_only() -> Iterator[None]:
    """argparse's and typer's parses raise ``_Parsed`` once they succeed."""
    import typer
    import typer.main

    real_parses = {name: getattr(argparse.ArgumentParser, name) for name in ("parse_args", "parse_known_args")}
    real_call = typer.Typer.__call__
    depth = [0]

    def stopping(real):  # type: ignore[no-untyped-def]
        def parse(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
            depth[0] += 1
            try:
                result = real(self, args, namespace)
            finally:
                depth[0] -= 1
            if depth[0] == 0:  # the outermost parse, sub-parsers and parse_args' own call done
                raise _Parsed
            return result
        return parse

    def call(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        _parse_typer(typer.main.get_command(self), sys.argv[1:])
        raise _Parsed

    for name, real in real_parses.items():
        setattr(argparse.ArgumentParser, name, stopping(real))
    typer.Typer.__call__ = call  # type: ignore[method-assign]
    try:
        yield
    finally:
        for name, real in real_parses.items():
            setattr(argparse.ArgumentParser, name, real)
        typer.Typer.__call__ = real_call  # type: ignore[method-assign]


def _parse_typer(command: object, args: list[str]) -> None:
    """Parses ``args`` with a typer command or group and its sub-commands; paths named in
    the documents need not exist on this machine."""
    from typer import Exit
    from typer.exceptions import TyperException

    try:
        ctx = command.make_context(getattr(command, "name", None) or "command", list(args))  # type: ignore[attr-defined]
        rest = list(getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", [])) + list(ctx.args)
        if hasattr(command, "resolve_command") and rest:
            _, sub, sub_args = command.resolve_command(ctx, rest)
            if sub is None:
                raise _ParseError(f"no command {rest[0]!r}")
            _parse_typer(sub, sub_args)
    except Exit as e:
        if e.exit_code:
            raise _ParseError(f"exit {e.exit_code}") from e
    except TyperException as e:  # the usage errors
        message = e.format_message() if hasattr(e, "format_message") else str(e)
        if not message.endswith("does not exist."):  # a path of the reader's machine
            raise _ParseError(message) from e


def _is_project_module(repo: Path, module: str) -> bool:
    spec = find_spec(module)
    origin = getattr(spec, "origin", None) or ""
    return origin.startswith(str(repo))


def _make_targets(makefile: Path) -> set[str]:
    targets: set[str] = set()
    for line in makefile.read_text(encoding="utf-8").splitlines():
        rule = re.match(r"^([A-Za-z0-9_.\- ]+?)\s*::?(?!=)", line)
        if rule and not line.startswith("\t"):
            targets.update(rule.group(1).split())
        phony = re.match(r"^\.PHONY:\s*(.*)", line)
        if phony:
            targets.update(phony.group(1).split())
    return targets


def console_scripts(pyproject: Path) -> dict[str, str]:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    return dict(data.get("project", {}).get("scripts", {}))


def check_commands(document: Path, checker: CommandChecker, prose: list[tuple[int, str]],
                    blocks: list[Block]) -> Iterator[Problem]:
    for number, command in _commands(blocks, prose):
        for argv in _words(command) or []:
            if argv[0] in {"make"} or not _has_placeholder(argv[:2]):
                why = checker.check(argv)
                if why and not (number < 0 and _INCOMPLETE.search(why)):
                    yield Problem(document, abs(number), why)
