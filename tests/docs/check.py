"""Checks that the documents say what is so at the commit they are at.

For each Markdown document (README.md, docs/*.md, bench/README.md, every package's
README.md) it reports:

- a repository path it names (``bench/results/x.json``, ``feeder/foo.py``,
  ``docs/x.md``, a link) that does not exist, or a link's ``#anchor`` that is no
  heading of the page it points to;
- a result file named bare (``throughput-256.json``) on a line naming a commit that is
  not in ``bench/results/``;
- an inline ``package.module.Name`` of the project's packages that does not import, or
  an inline bare source file name (``loader.py``) that no file of the repository has;
- a command in a shell code block (or an inline ``make``/``python``/``feeder`` span)
  that would not parse: ``make TARGET`` against the Makefile's targets, the project's
  console scripts and ``python -m MODULE`` / ``torchrun -m MODULE`` through their real
  typer or argparse parsers, ``python SCRIPT.py`` through the script's own parser.
  Nothing is run: the parse is stopped as soon as it has succeeded;
- a Python block that does not parse, or calls what it imports from the project with
  a keyword its signature lacks; a TOML block that does not parse.

Everything is read at check time (the repository's folders, the Makefile, the console
scripts in pyproject.toml, the modules themselves), so a module moved or an option
renamed is checked as it is, not as a list here remembers it.
"""

from __future__ import annotations

import argparse
import ast
import contextlib
import fnmatch
import importlib
import importlib.util
import inspect
import io
import re
import runpy
import shlex
import sys
import tomllib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Problem", "check_document", "check_repository", "documents"]

REPO = Path(__file__).resolve().parents[2]
_SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}
_PYTHONS = re.compile(r"^(?:\S*/)?python(?:3(?:\.\d+)?)?$")
# Programs that run another command given after their own options.
_WRAPPERS = {"srun", "nice", "exec", "env", "time", "nohup", "sudo"}
# A path-like token: letters, digits and ./_-*, in parts separated by slashes.
_PATH_TOKEN = re.compile(r"[\w.*-]+(?:/[\w.*-]+)*/?")
_SOURCE_SUFFIXES = (".py", ".c", ".sh", ".proto")
# A commit named as a figure's source (`25431d3`): a bare result file on its line is in bench/results/.
_COMMIT = re.compile(r"`[0-9a-f]{7,40}`")
# What a span of prose may leave out when it names a command (`feeder serve`, `--cache-dir`).
_INCOMPLETE = re.compile(r"Missing (?:argument|option|parameter)|requires an argument|expected one argument|"
                         r"the following arguments are required")


@dataclass(frozen=True)
class Problem:
    """One thing a document says that is not so."""

    document: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.message}"


# --- documents -----------------------------------------------------------------------------------


def documents(repo: Path = REPO) -> list[Path]:
    """The Markdown documents checked: the top README, docs/, and a README in any top folder."""
    found = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    found += sorted(p for p in repo.glob("*/README.md") if not p.parent.name.startswith("."))
    return [p for p in found if p.is_file()]


@dataclass(frozen=True)
class _Block:
    language: str
    first_line: int
    lines: list[str]


def _split(text: str) -> tuple[list[tuple[int, str]], list[_Block]]:
    """Prose lines (numbered from 1) and fenced code blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[_Block] = []
    block: _Block | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block = _Block(fence.group(1).lower(), number + 1, [])
        elif fence:
            blocks.append(block)  # type: ignore[arg-type]
            block = None
        elif block is not None:
            block.lines.append(line)
        else:
            prose.append((number, line))
    return prose, blocks


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"[`*]|\[([^\]]*)\]\([^)]*\)", lambda m: m.group(1) or "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(document: Path) -> set[str]:
    prose, _ = _split(document.read_text(encoding="utf-8"))
    slugs: set[str] = set()
    for _, line in prose:
        heading = re.match(r"^#{1,6}\s+(.*)", line)
        if heading:
            base = _slug(heading.group(1))
            slug, n = base, 0
            while slug in slugs:
                n += 1
                slug = f"{base}-{n}"
            slugs.add(slug)
    return slugs


# --- paths ---------------------------------------------------------------------------------------


def _top_names(repo: Path) -> set[str]:
    """The repository's top-level folders and files that a path in a document may start with
    (not the ones git ignores: a run's outputs, such as ``gpu-out/``)."""
    ignore = repo / ".gitignore"
    ignored = [line.strip().strip("/") for line in ignore.read_text(encoding="utf-8").splitlines()
               if line.strip() and not line.startswith("#")] if ignore.is_file() else []
    return {p.name for p in repo.iterdir()
            if not p.name.startswith(".") and not any(fnmatch.fnmatch(p.name, pattern) for pattern in ignored)}


def _exists(repo: Path, path: str) -> bool:
    path = path.rstrip("/.,:;")
    if any(c in path for c in "*?["):
        return any(repo.glob(path))
    return (repo / path).exists()


def _result_stems(repo: Path) -> set[str]:
    """The leading words of bench/results/ files (``throughput``, ``shard``): a bare name
    starting with one of them is a result file."""
    results = repo / "bench" / "results"
    return {re.split(r"[-.]", p.name, maxsplit=1)[0] for p in results.iterdir()} if results.is_dir() else set()


def _check_paths(document: Path, repo: Path, prose: list[tuple[int, str]], blocks: list[_Block]) -> Iterator[Problem]:
    tops = _top_names(repo)
    stems = _result_stems(repo)
    lines = list(prose) + [(b.first_line + i, line) for b in blocks if b.language in _SHELL_LANGUAGES
                           for i, line in enumerate(b.lines)]
    for number, line in lines:
        for link in re.finditer(r"\]\(([^)\s]+)\)", line):
            yield from _check_link(document, repo, number, link.group(1))
        for token in _PATH_TOKEN.finditer(re.sub(r"\]\([^)]*\)|https?://\S+|\w+://\S+", " ", line)):
            text = token.group(0).rstrip(".,:;")
            start = token.start()
            if start and line[start - 1] in "/~$.=-@":  # part of an absolute path, a URL, a variable
                continue
            first = text.split("/", 1)[0]
            if "..." in line[start:token.end() + 3] or line[token.end():token.end() + 1] == "<":
                continue  # a placeholder: tests/..., bench/<script>.py
            if "/" in text and first in tops and first != text.rstrip("/"):
                if not _exists(repo, text):
                    yield Problem(document, number, f"no such file in the repository: {text}")
            elif "/" not in text and text.endswith((".json", ".png")) and _COMMIT.search(line) \
                    and text.split(".")[0].split("-")[0] in stems:
                if not _exists(repo, f"bench/results/{text}") and not _exists(repo, text):
                    yield Problem(document, number, f"no such result file in bench/results/: {text}")


def _packages(repo: Path) -> set[str]:
    """The repository's top-level Python packages (``feeder``, ``clients``, ...)."""
    return {p.parent.name for p in repo.glob("*/__init__.py")}


def _file_names(repo: Path) -> set[str]:
    """The names of the repository's source files, wherever they are."""
    tops = _top_names(repo)
    return {p.name for top in tops if (repo / top).is_dir() for p in (repo / top).rglob("*")
            if "__pycache__" not in p.parts} | {p.name for p in repo.iterdir() if p.is_file()}


def _resolves(name: str) -> bool:
    """Whether ``name`` (``feeder.cli``, ``clients.FeederLoader``, ``feeder.resize.BatchResizer``)
    is a module, or an attribute of the longest module it starts with."""
    parts = name.split(".")
    if "__main__" in parts:  # importing it would run it
        return _find_spec(name) is not None
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if _find_spec(module) is None:
            continue
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # an old name is still a name
            target: object = importlib.import_module(module)
            for attr in parts[cut:]:
                if not hasattr(target, attr):
                    return False
                target = getattr(target, attr)
        return True
    return False


def _check_names(document: Path, repo: Path, prose: list[tuple[int, str]]) -> Iterator[Problem]:
    """Inline ``module.names`` of the project's packages resolve; inline bare source file
    names (``loader.py``) are some file of the repository."""
    packages, files = _packages(repo), None
    for number, line in prose:
        for span in re.finditer(r"`([A-Za-z_][\w.]*)(?:\(\))?`", line):
            text = span.group(1)
            if "." not in text or text.endswith("."):
                continue
            if text.endswith(_SOURCE_SUFFIXES):
                files = files if files is not None else _file_names(repo)
                if "/" not in text and text not in files:
                    yield Problem(document, number, f"no source file of that name in the repository: {text}")
            elif text.split(".", 1)[0] in packages and not _resolves(text):
                yield Problem(document, number, f"no such module or name: {text}")


def _check_code(document: Path, repo: Path, blocks: list[_Block]) -> Iterator[Problem]:
    """Python blocks parse, and a call of something they import from the project's
    packages names only keywords its signature has; TOML blocks parse."""
    for block in blocks:
        source = "\n".join(block.lines)
        if block.language == "toml":
            try:
                tomllib.loads(source)
            except tomllib.TOMLDecodeError as e:
                yield Problem(document, block.first_line, f"TOML does not parse: {e}")
        elif block.language == "python":
            try:
                tree = ast.parse(source)
            except SyntaxError as e:
                yield Problem(document, block.first_line + (e.lineno or 1) - 1, f"Python does not parse: {e.msg}")
                continue
            for line, why in _call_problems(tree, _packages(repo)):
                yield Problem(document, block.first_line + line - 1, why)


def _call_problems(tree: ast.Module, packages: set[str]) -> Iterator[tuple[int, str]]:
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in packages:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported):
            continue
        name = imported[node.func.id]
        if not _resolves(name):
            yield node.lineno, f"no such module or name: {name}"
            continue
        module, _, attr = name.rpartition(".")
        try:
            parameters = inspect.signature(getattr(importlib.import_module(module), attr)).parameters
        except (TypeError, ValueError):  # no signature to check against
            continue
        if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            continue
        for keyword in node.keywords:
            if keyword.arg is not None and keyword.arg not in parameters:
                yield node.lineno, f"{name} takes no argument {keyword.arg!r}"


def _check_link(document: Path, repo: Path, number: int, target: str) -> Iterator[Problem]:
    if re.match(r"^[a-z]+:", target):
        return
    path, _, anchor = target.partition("#")
    linked = (document.parent / path).resolve() if path else document
    if not linked.exists():
        yield Problem(document, number, f"link to a missing file: {target}")
    elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
        yield Problem(document, number, f"link to a missing heading: {target}")


# --- commands ------------------------------------------------------------------------------------


class _Parsed(Exception):
    """Raised once a command line has been parsed: nothing after the parse runs."""


def _commands(blocks: list[_Block], prose: list[tuple[int, str]]) -> Iterator[tuple[int, str]]:
    """Each command of the shell blocks (continuation lines joined, ``$ `` prompts and
    comments dropped), and inline ``make``/``python``/``feeder`` spans of the prose."""
    for block in blocks:
        if block.language not in _SHELL_LANGUAGES:
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


class _Checker:
    """Parses command lines with the project's own parsers, stopping each after its parse."""

    def __init__(self, repo: Path) -> None:
        self.repo = repo
        self.targets = _make_targets(repo / "Makefile")
        self.scripts = _console_scripts(repo / "pyproject.toml")

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
            if _find_spec(module) is None:
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


def _find_spec(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except ImportError:  # its package is missing
        return None


def _is_project_module(repo: Path, module: str) -> bool:
    spec = _find_spec(module)
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


def _console_scripts(pyproject: Path) -> dict[str, str]:
    data = tomllib.loads(pyproject.read_text(encoding="utf-8"))
    return dict(data.get("project", {}).get("scripts", {}))


def _check_commands(document: Path, checker: _Checker, prose: list[tuple[int, str]],
                    blocks: list[_Block]) -> Iterator[Problem]:
    for number, command in _commands(blocks, prose):
        for argv in _words(command) or []:
            if argv[0] in {"make"} or not _has_placeholder(argv[:2]):
                why = checker.check(argv)
                if why and not (number < 0 and _INCOMPLETE.search(why)):
                    yield Problem(document, abs(number), why)


# --- entry points --------------------------------------------------------------------------------


def check_document(document: Path, repo: Path = REPO, checker: _Checker | None = None) -> list[Problem]:
    """Everything ``document`` says that is not so in ``repo``."""
    prose, blocks = _split(document.read_text(encoding="utf-8"))
    checker = checker or _Checker(repo)
    return [*_check_paths(document, repo, prose, blocks), *_check_names(document, repo, prose),
            *_check_code(document, repo, blocks), *_check_commands(document, checker, prose, blocks)]


def check_repository(repo: Path = REPO) -> list[Problem]:
    """Every problem of every document of ``repo``."""
    checker = _Checker(repo)
    return [p for d in documents(repo) for p in check_document(d, repo, checker)]


if __name__ == "__main__":
    problems = check_repository()
    for problem in problems:
        print(problem)
    sys.exit(1 if problems else 0)
