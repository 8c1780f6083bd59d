"""What the sharder finds in SRC, whatever SRC is (a folder tree, the image-net.org
tars, an object store prefix): the classes, and per split its inputs in walk order,
each a source name relative to SRC and a label, with the :class:`Source` that reads
them.

Source names are those of the extracted folder tree (``train/<wnid>/<file>``,
``val/<file>``) whatever the layout, so that the same images sharded from the tars
or from their extracted tree give the same keys, index and shards.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import ConfigError
from sharder.source_reads import Source

__all__ = ["IMAGE_EXTENSIONS", "SourceFile", "SourceTree", "SplitSource", "checked", "is_image"]

log = logging.getLogger("sharder.sources")  # one logger for what finding the inputs warns of

IMAGE_EXTENSIONS = frozenset({".jpg", ".jpeg", ".png", ".bmp", ".webp"})


def is_image(name: str) -> bool:
    """Whether a file of this name is a sample (by its extension, any case)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


@dataclass(frozen=True)
class SourceFile:
    """One input sample: ``source`` is its path relative to SRC (POSIX form)."""

    source: str
    label: int


@dataclass
class SplitSource:
    """The inputs of one split, in walk order (class folders sorted, each top-down),
    and the source that reads them.

    ``rejects`` and ``skipped_links`` are ``(source, reason)`` pairs; ``empty_classes``
    names the class folders of this split that hold no image file.
    """

    name: str
    files: list[SourceFile] = field(default_factory=list)
    ignored: int = 0
    rejects: list[tuple[str, str]] = field(default_factory=list)
    skipped_links: list[tuple[str, str]] = field(default_factory=list)
    empty_classes: list[str] = field(default_factory=list)
    reader: Source = field(kw_only=True)


@dataclass
class SourceTree:
    """Everything found under SRC (a folder, or the URL of a store prefix)."""

    root: Path | str
    layout: str
    classes: list[str]
    splits: list[SplitSource]


def checked(tree: SourceTree) -> SourceTree:
    """``tree``, once it holds an input; one warning per skipped link and per empty
    class (the manifest lists them too).

    Raises:
        ConfigError: no split holds an image file.
    """
    if not any(split.files or split.rejects for split in tree.splits):
        raise ConfigError(f"SRC {tree.root} holds no image files ({', '.join(sorted(IMAGE_EXTENSIONS))})")
    for split in tree.splits:
        for source, reason in split.skipped_links:
            log.warning("%s: symlink not followed (%s)", split.reader.shown(source), reason)
        for name in split.empty_classes:
            log.warning("%s: class %r has no images in split %s; kept as label %d with 0 samples",
                        tree.root, name, split.name, tree.classes.index(name))
    return tree
