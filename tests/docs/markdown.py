"""Reading the documents: which they are, their prose lines and fenced blocks, their
headings' anchors, and what a problem found in them is."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

__all__ = ["REPO", "SHELL_LANGUAGES", "Block", "Problem", "anchors", "documents", "split_document"]

REPO = Path(__file__).resolve().parents[2]
SHELL_LANGUAGES = {"", "bash", "sh", "shell", "console"}


@dataclass(frozen=True)
class Problem:
    """One thing a document says that is not so."""

    document: Path
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.document}:{self.line}: {self.message}"


def documents(repo: Path = REPO) -> list[Path]:
    """The Markdown documents checked: the top README, docs/, and a README in any top folder."""
    found = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    found += sorted(p for p in repo.glob("*/README.md") if not p.parent.name.startswith("."))
    return [p for p in found if p.is_file()]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its language, the line of its first line, its lines."""

    language: str
    first_line: int
    lines: list[str]


def split_document(text: str) -> tuple[list[tuple[int, str]], list[Block]]:
    """Prose lines (numbered from 1) and fenced code blocks."""
    prose: list[tuple[int, str]] = []
    blocks: list[Block] = []
    block: Block | None = None
    for number, line in enumerate(text.splitlines(), 1):
        fence = re.match(r"^\s*```(\w*)", line)
        if fence and block is None:
            block = Block(fence.group(1).lower(), number + 1, [])
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


def anchors(document: Path) -> set[str]:
    prose, _ = split_document(document.read_text(encoding="utf-8"))
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
