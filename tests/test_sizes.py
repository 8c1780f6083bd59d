"""Each source module reads in one sitting and the README stays a quick start: no
module of the packages over 400 lines (generated ``*_pb2`` modules aside), the README
at most 150."""

from __future__ import annotations

from tests.test_imports import PACKAGES, ROOT

MAX_MODULE_LINES, MAX_README_LINES = 400, 150


def _lines(text: str) -> int:
    return len(text.splitlines())


def test_no_source_module_is_over_400_lines() -> None:
    long = {str(path.relative_to(ROOT)): _lines(path.read_text())
            for package in PACKAGES for path in sorted((ROOT / package).rglob("*.py"))
            if not path.name.endswith(("_pb2.py", "_pb2_grpc.py"))}
    assert len(long) > 100, "the packages' modules were found"
    assert {path: n for path, n in long.items() if n > MAX_MODULE_LINES} == {}


def test_the_readme_is_at_most_150_lines() -> None:
    assert _lines((ROOT / "README.md").read_text()) <= MAX_README_LINES
