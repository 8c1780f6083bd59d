"""What the documents name must exist: repository paths, links and their anchors, result
files, module names, source file names, and the Python and TOML of their blocks."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import importlib.util
import inspect
import re
import tomllib
import warnings
from collections.abc import Iterator
from pathlib import Path

from tests.docs.markdown import SHELL_LANGUAGES, Block, Problem, anchors

__all__ = ["check_code", "check_names", "check_paths", "find_spec", "packages", "resolves"]

# A path-like token: letters, digits and ./_-*, in parts separated by slashes.
_PATH_TOKEN = re.compile(r"[\w.*-]+(?:/[\w.*-]+)*/?")
_SOURCE_SUFFIXES = (".py", ".c", ".sh", ".proto")
# A commit named as a figure's source (`25431d3`): a bare result file on its line is in bench/results/.
_COMMIT = re.compile(r"`[0-9a-f]{7,40}`")


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


def check_paths(document: Path, repo: Path, prose: list[tuple[int, str]], blocks: list[Block]) -> Iterator[Problem]:
    tops = _top_names(repo)
    stems = _result_stems(repo)
    lines = list(prose) + [(b.first_line + i, line) for b in blocks if b.language in SHELL_LANGUAGES
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


def packages(repo: Path) -> set[str]:
    """The repository's top-level Python packages (``feeder``, ``clients``, ...)."""
    return {p.parent.name for p in repo.glob("*/__init__.py")}


def _file_names(repo: Path) -> set[str]:
    """The names of the repository's source files, wherever they are."""
    tops = _top_names(repo)
    return {p.name for top in tops if (repo / top).is_dir() for p in (repo / top).rglob("*")
            if "__pycache__" not in p.parts} | {p.name for p in repo.iterdir() if p.is_file()}


def resolves(name: str) -> bool:
    """Whether ``name`` (``feeder.cli``, ``clients.FeederLoader``, ``decode.resize.BatchResizer``)
    is a module, or an attribute of the longest module it starts with."""
    parts = name.split(".")
    if "__main__" in parts:  # importing it would run it
        return find_spec(name) is not None
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        if find_spec(module) is None:
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


def check_names(document: Path, repo: Path, prose: list[tuple[int, str]]) -> Iterator[Problem]:
    """Inline ``module.names`` of the project's packages resolve; inline bare source file
    names (``loader.py``) are some file of the repository."""
    names, files = packages(repo), None
    for number, line in prose:
        for span in re.finditer(r"`([A-Za-z_][\w.]*)(?:\(\))?`", line):
            text = span.group(1)
            if "." not in text or text.endswith("."):
                continue
            if text.endswith(_SOURCE_SUFFIXES):
                files = files if files is not None else _file_names(repo)
                if "/" not in text and text not in files:
                    yield Problem(document, number, f"no source file of that name in the repository: {text}")
            elif text.split(".", 1)[0] in names and not resolves(text):
                yield Problem(document, number, f"no such module or name: {text}")


def check_code(document: Path, repo: Path, blocks: list[Block]) -> Iterator[Problem]:
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
            for line, why in _call_problems(tree, packages(repo)):
                yield Problem(document, block.first_line + line - 1, why)


def _call_problems(tree: ast.Module, project: set[str]) -> Iterator[tuple[int, str]]:
    imported: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in project:
            for alias in node.names:
                imported[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in imported):
            continue
        name = imported[node.func.id]
        if not resolves(name):
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
    elif anchor and linked.suffix == ".md" and anchor not in anchors(linked):
        yield Problem(document, number, f"link to a missing heading: {target}")


def find_spec(module: str) -> object | None:
    try:
        return importlib.util.find_spec(module)
    except ImportError:  # its package is missing
        return None
