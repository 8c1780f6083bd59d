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
  a keyword its signature lacks; a TOML block that does not parse;
- a default stated for an option of the project's commands (`` `--restarts` (default
  5) ``) that is not the parser's.

Everything is read at check time (the repository's folders, the Makefile, the console
scripts in pyproject.toml, the modules themselves), so a module moved or an option
renamed is checked as it is, not as a list here remembers it.
"""

from __future__ import annotations

import sys
from pathlib import Path

from tests.docs.commands import CommandChecker, check_commands
from tests.docs.defaults import check_defaults, option_defaults
from tests.docs.markdown import REPO, Problem, documents, split_document
from tests.docs.references import check_code, check_names, check_paths

__all__ = ["REPO", "Problem", "check_document", "check_repository", "documents"]


def check_document(document: Path, repo: Path = REPO, checker: CommandChecker | None = None,
                   defaults: dict[str, set[object]] | None = None) -> list[Problem]:
    """Everything ``document`` says that is not so in ``repo``."""
    prose, blocks = split_document(document.read_text(encoding="utf-8"))
    checker = checker or CommandChecker(repo)
    defaults = option_defaults(repo) if defaults is None else defaults
    return [*check_paths(document, repo, prose, blocks), *check_names(document, repo, prose),
            *check_code(document, repo, blocks), *check_commands(document, checker, prose, blocks),
            *check_defaults(document, defaults, prose)]


def check_repository(repo: Path = REPO) -> list[Problem]:
    """Every problem of every document of ``repo``."""
    checker, defaults = CommandChecker(repo), option_defaults(repo)
    return [p for d in documents(repo) for p in check_document(d, repo, checker, defaults)]


if __name__ == "__main__":
    problems = check_repository()
    for problem in problems:
        print(problem)
    sys.exit(1 if problems else 0)
