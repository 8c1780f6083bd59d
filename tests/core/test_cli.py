"""core.cli: sizes written and read back, the one-line warning."""

from __future__ import annotations

import pytest

from core.cli import format_bytes, parse_bytes, parse_list, print_warning


@pytest.mark.parametrize("value,text", [
    (0, "0"), (1000, "1000"), (1 << 10, "1K"), (256 << 20, "256M"), (3 << 29, "1536M"), (4 << 30, "4G"),
    (1 << 40, "1T"), (89_478_485, "89478485"),
])
def test_format_bytes_is_read_back_by_parse_bytes(value: int, text: str) -> None:
    assert format_bytes(value) == text
    assert parse_bytes(text, "--x-bytes") == value


def test_parse_list_drops_blanks() -> None:
    assert parse_list("wds, lmdb,", "--formats") == ("wds", "lmdb")
    assert parse_list("", "--formats") == ()


def test_print_warning_is_one_line_on_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    print_warning("--old is deprecated, use --new")
    out, err = capsys.readouterr()
    assert out == "" and err == "feeder: warning: --old is deprecated, use --new\n"
