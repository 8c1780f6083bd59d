"""sharder.sources: which files become samples, under which label, when SRC holds
symbolic links, empty class folders and directories that cannot be listed."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from core.errors import DataError
from sharder import sources
from sharder.sources import find_sources
from tests.sharder.odd_files import make_unlistable, rgb_jpeg, write_tree


def _tree(root: Path) -> Path:
    """``apple/`` (2 images, one in a subfolder) and ``zebra/`` (1 image)."""
    return write_tree(
        root,
        {"apple": {"a0.jpg": rgb_jpeg(0)}, "apple/sub": {"a1.jpg": rgb_jpeg(1)}, "zebra": {"z0.jpg": rgb_jpeg(2)}},
    )


def _labelled(split: sources.SplitSource) -> list[tuple[str, int]]:
    return [(f.source, f.label) for f in split.files]


@pytest.mark.parametrize("layout", ["folders", "ilsvrc"])
def test_class_folder_linked_to_its_parent_adds_no_sample(
    tmp_path: Path, layout: str, caplog: pytest.LogCaptureFixture
) -> None:
    base = _tree(tmp_path / "src" / "train") if layout == "ilsvrc" else _tree(tmp_path / "src")
    (base / "x").symlink_to(".")  # ln -s . x: before, every image came back as class x
    with caplog.at_level(logging.WARNING, logger="sharder.sources"):
        tree = find_sources(tmp_path / "src")
    prefix = "train/" if layout == "ilsvrc" else ""
    assert tree.classes == ["apple", "x", "zebra"]  # kept: labels are the sorted folder names
    (split,) = tree.splits
    assert _labelled(split) == [
        (f"{prefix}apple/a0.jpg", 0),
        (f"{prefix}apple/sub/a1.jpg", 0),
        (f"{prefix}zebra/z0.jpg", 2),
    ]
    assert [source for source, _ in split.skipped_links] == [f"{prefix}x"]
    assert "loop" in split.skipped_links[0][1]
    assert split.empty_classes == ["x"]
    assert any(f"{prefix}x" in r.getMessage() and "symlink" in r.getMessage() for r in caplog.records)


def test_links_inside_a_class_folder_never_repeat_a_file(tmp_path: Path) -> None:
    src = _tree(tmp_path / "src")
    (src / "apple" / "sub" / "up").symlink_to("..")  # a loop inside a class folder
    (src / "apple" / "sub" / "root").symlink_to("../..")  # above every class folder
    (src / "zebra" / "apples").symlink_to("../apple")  # another class folder
    (src / "zebra" / "again.jpg").symlink_to("z0.jpg")  # a file already sharded
    (src / "a_copy").symlink_to("apple")  # a class folder sorting before its target
    (split,) = find_sources(src).splits
    assert _labelled(split) == [("apple/a0.jpg", 1), ("apple/sub/a1.jpg", 1), ("zebra/z0.jpg", 2)]
    assert sorted(source for source, _ in split.skipped_links) == [
        "a_copy",
        "apple/sub/root",
        "apple/sub/up",
        "zebra/again.jpg",
        "zebra/apples",
    ]
    assert all(reason for _, reason in split.skipped_links)
    assert split.empty_classes == ["a_copy"]


def test_class_folder_linked_outside_src_is_followed(tmp_path: Path) -> None:
    elsewhere = write_tree(
        tmp_path / "elsewhere", {"cats": {"c0.jpg": rgb_jpeg(3)}, "cats/more": {"c1.jpg": rgb_jpeg(4)}}
    )
    (elsewhere / "cats" / "more" / "back").symlink_to("..")  # a loop outside SRC
    src = _tree(tmp_path / "src")
    (src / "cat").symlink_to(elsewhere / "cats")
    (src / "zebra" / "extra").symlink_to(elsewhere / "cats" / "more")  # already reached through cat
    (split,) = find_sources(src).splits
    assert _labelled(split) == [
        ("apple/a0.jpg", 0),
        ("apple/sub/a1.jpg", 0),
        ("cat/c0.jpg", 1),
        ("cat/more/c1.jpg", 1),
        ("zebra/z0.jpg", 2),
    ]
    assert sorted(source for source, _ in split.skipped_links) == ["cat/more/back", "zebra/extra"]
    assert split.empty_classes == []


def test_empty_class_folder_keeps_its_label_and_is_named(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    src = _tree(tmp_path / "src")
    (src / "mango").mkdir()
    (src / "mango" / "notes.txt").write_text("no images here")
    with caplog.at_level(logging.WARNING, logger="sharder.sources"):
        tree = find_sources(src)
    assert tree.classes == ["apple", "mango", "zebra"]
    assert tree.splits[0].empty_classes == ["mango"]
    assert [f.label for f in tree.splits[0].files] == [0, 0, 2]
    assert any("mango" in r.getMessage() and "no images" in r.getMessage() for r in caplog.records)


def test_unreadable_directory_is_a_reject_with_its_reason(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    src = _tree(tmp_path / "src")
    make_unlistable(monkeypatch, src / "apple" / "sub")
    (split,) = find_sources(src).splits
    assert _labelled(split) == [("apple/a0.jpg", 0), ("zebra/z0.jpg", 1)]
    assert split.rejects == [("apple/sub", "cannot list directory: Permission denied")]


def test_unreadable_directory_with_on_error_fail_stops_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    src = _tree(tmp_path / "src")
    make_unlistable(monkeypatch, src / "apple" / "sub")
    with pytest.raises(DataError, match=r"apple/sub: cannot list directory: Permission denied"):
        find_sources(src, on_error="fail")
