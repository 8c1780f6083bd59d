"""The documents against the code (``make docs-check``), and the checker against
documents broken on purpose."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from tests.docs.check import REPO, check_document, check_repository, documents


def _doc(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "doc.md"
    path.write_text(textwrap.dedent(text), encoding="utf-8")
    return path


def _problems(tmp_path: Path, text: str, repo: Path = REPO) -> list[str]:
    return [p.message for p in check_document(_doc(tmp_path, text), repo)]


def test_the_documents_say_what_is_so() -> None:
    problems = check_repository()
    assert not problems, "\n".join(str(p) for p in problems)


def test_the_documents_include_the_readme_and_docs() -> None:
    names = {p.relative_to(REPO).as_posix() for p in documents()}
    assert {"README.md", "docs/performance.md", "bench/README.md"} <= names


def test_a_missing_path_is_reported(tmp_path: Path) -> None:
    problems = _problems(tmp_path, "Measured by `bench/no_such_bench.py`, kept in bench/results/nope.json.\n")
    assert problems == ["no such file in the repository: bench/no_such_bench.py",
                        "no such file in the repository: bench/results/nope.json"]


def test_a_missing_result_file_named_bare_is_reported(tmp_path: Path) -> None:
    assert _problems(tmp_path, "| run | `throughput-no-such-run.json` at `0f4c8e9` |\n") == [
        "no such result file in bench/results/: throughput-no-such-run.json"]


def test_a_link_to_a_missing_file_or_heading_is_reported(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n", encoding="utf-8")
    problems = _problems(tmp_path, """\
        # Here
        [ok](other.md#a-section), [ok](#here), [gone](gone.md), [no heading](other.md#no-section)
        """)
    assert problems == ["link to a missing file: gone.md", "link to a missing heading: other.md#no-section"]


def test_existing_paths_links_and_placeholders_pass(tmp_path: Path) -> None:
    assert _problems(tmp_path, """\
        `docs/performance.md`, bench/results/ and `tests/...::test_name`, `bench/<script>.py`,
        [the README](../../README.md) is not checked here, /tmp/feeder.sock and s3://bucket/prefix/x.json
        """.replace("../../README.md", str(REPO / "README.md"))) == []


def test_a_module_or_name_that_moved_is_reported(tmp_path: Path) -> None:
    problems = _problems(tmp_path, """\
        `decode.resize.BatchResizer`, `clients.FeederLoader`, `feeder.__main__` and `resize.py` are there;
        `feeder.no_such_module`, `decode.resize.NoSuchName` and `no_such_module.py` are not.
        """)
    assert problems == ["no such module or name: feeder.no_such_module",
                        "no such module or name: decode.resize.NoSuchName",
                        "no source file of that name in the repository: no_such_module.py"]


def test_python_and_toml_blocks_are_checked(tmp_path: Path) -> None:
    problems = _problems(tmp_path, """\
        ```python
        from clients import FeederLoader

        loader = FeederLoader("127.0.0.1:50051", dataset="imagenet", batch_size=256)
        loader = FeederLoader("127.0.0.1:50051", dataset="imagenet", no_such_argument=1)
        ```

        ```python
        for x in
        ```

        ```toml
        [phase
        ```
        """)
    assert len(problems) == 3, problems
    assert problems[0].endswith("takes no argument 'no_such_argument'")
    assert problems[1].startswith("Python does not parse")
    assert problems[2].startswith("TOML does not parse")


def test_a_default_that_is_not_the_parsers_is_reported(tmp_path: Path) -> None:
    problems = _problems(tmp_path, """\
        `--restarts` (default 5), `--shm-budget-bytes` (default 4 GiB), `--max-pixels` (default
        89,478,485), `--max-memory-bytes` (default: half the machine's), `--grace-s` (default 5 s).
        `--restarts` (default 7); `--cache-bytes` (default 10G).
        """)
    assert problems == ["--restarts: the document says default 7, the parser has 5",
                        "--cache-bytes: the document says default 10G, the parser has '100G'"]


def test_an_unknown_make_target_is_reported(tmp_path: Path) -> None:
    assert _problems(tmp_path, "```bash\nmake test\nmake chaos SEEDS=20\nmake no-such-target\n```\n") == [
        "make has no target 'no-such-target'"]


def test_a_feeder_command_is_parsed_by_its_own_parser(tmp_path: Path) -> None:
    problems = _problems(tmp_path, """\
        ```bash
        feeder serve --dataset imagenet=/data/shards --port 50051
        feeder serve --dataset imagenet=/data/shards --no-such-option 3
        feeder serve --dataset imagenet=/data/shards --port many
        feeder no-such-command
        ```
        """)
    assert len(problems) == 3, problems
    assert "--no-such-option" in problems[0]
    assert "many" in problems[1]
    assert "no-such-command" in problems[2]


def test_the_command_after_feeder_run_is_checked_too(tmp_path: Path) -> None:
    problems = _problems(tmp_path, """\
        ```bash
        feeder run --dataset imagenet=/data/shards --socket-path /tmp/f.sock -- \\
            torchrun --nproc-per-node 8 -m trainer.train --dataset imagenet --no-such-option
        ```
        """)
    assert len(problems) == 1 and "--no-such-option" in problems[0], problems


def test_a_python_module_must_exist(tmp_path: Path) -> None:
    assert _problems(tmp_path, "```sh\npython -m feeder.no_such_module --help\n```\n") == [
        "no module 'feeder.no_such_module'"]


def test_an_inline_span_may_name_a_command_without_its_arguments(tmp_path: Path) -> None:
    assert _problems(tmp_path, "`feeder serve`, `feeder verify` and `make demo`\n") == []
    assert len(_problems(tmp_path, "`feeder serve --no-such-option`\n")) == 1


@pytest.fixture
def script_repo(tmp_path: Path) -> Path:
    """A repository of one argparse script, a Makefile and no console scripts."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    (repo / "Makefile").write_text("demo:\n\techo\n", encoding="utf-8")
    (repo / "pyproject.toml").write_text("[project]\nname = 'x'\n", encoding="utf-8")
    (repo / "bench" / "tool.py").write_text(textwrap.dedent("""\
        import argparse, sys
        parser = argparse.ArgumentParser()
        parser.add_argument("--rounds", type=int, default=1)
        parser.parse_args()
        sys.exit("ran past its parse")
        """), encoding="utf-8")
    return repo


def test_a_script_is_parsed_by_its_own_parser_and_not_run(tmp_path: Path, script_repo: Path) -> None:
    problems = _problems(tmp_path, """\
        ```bash
        python bench/tool.py --rounds 3
        python bench/tool.py --help
        python bench/tool.py --rounds three
        python bench/tool.py --no-such-option
        python bench/gone.py
        ```
        """, repo=script_repo)
    assert len(problems) == 4, problems
    assert problems[0] == "no such file in the repository: bench/gone.py"
    assert "invalid int value: 'three'" in problems[1]
    assert "unrecognized arguments: --no-such-option" in problems[2]
    assert problems[3] == "no such script: bench/gone.py"
