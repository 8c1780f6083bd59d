"""List the files under a split's folders so that each real file is listed once,
whatever symbolic links the tree holds.

Real (non-link) directories are walked first, all of them, in every split; the links
met on the way wait. Then the links to directories are taken in rounds (those met
while following a round wait for the next), each round shallowest target first. A
link to a directory is followed, like any folder, unless its target is a directory
already walked or one above such a directory: a loop (``ln -s . x``, ``up -> ..``), a
second name for a class folder, the split folder itself. A link that points outside
SRC (a dataset kept on another disk) is followed. Last, a link to an image file is
kept unless its target is a file already listed or the target of an earlier link.
Every link not followed is reported with its reason.

A directory that cannot be listed is reported with the reason (``on_error="skip"``)
or stops the walk (``"fail"``); it never loses its files silently the way
``os.walk`` does.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from core.errors import DataError

__all__ = ["Listing", "TreeWalker", "list_dir", "walk_order"]


def list_dir(path: str | Path) -> list[os.DirEntry[str]]:
    """The entries of ``path`` sorted by name (raises ``OSError`` like ``os.scandir``)."""
    with os.scandir(path) as entries:
        return sorted(entries, key=lambda e: e.name)


@dataclass
class Listing:
    """What the walk found for one split. Sources are paths relative to SRC through
    the names walked (links included); a tag is the caller's, e.g. the label."""

    images: list[tuple[str, int]] = field(default_factory=list)  # (source, tag), in walk order
    ignored: int = 0  # files that are not images
    unlisted: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    skipped_links: list[tuple[str, str]] = field(default_factory=list)  # (source, reason)
    followed_links: int = 0


@dataclass(frozen=True)
class _Link:
    listing: Listing
    source: str
    path: str  # as reached, through the links above it
    parent: str  # real path of the directory holding the link
    tag: int

    @property
    def target(self) -> str:
        return os.path.realpath(self.path)


def walk_order(source: str) -> tuple[list[str], str]:
    """Sort key giving ``os.walk``'s top-down order: a folder's files, then its subfolders."""
    folder, _, name = source.rpartition("/")
    return folder.split("/"), name


class TreeWalker:
    """Walks folders of one SRC, remembering every directory walked.

    Args:
        root: SRC; sources are relative to it.
        is_image: whether a file name is a sample.
        uncounted: names that are neither samples nor counted as ignored.
        on_error: ``"skip"`` reports a directory that cannot be listed; ``"fail"``
            raises ``DataError`` naming it.
    """

    def __init__(self, root: Path, is_image: Callable[[str], bool], uncounted: Iterable[str], on_error: str = "skip"):
        self.root, self.on_error = root, on_error
        self._is_image = is_image
        self._uncounted = frozenset(uncounted)
        self._walked: set[str] = set()  # real paths of directories listed (or tried)
        self._unlisted: set[str] = set()
        self._dir_links: list[_Link] = []
        self._file_links: list[_Link] = []
        self._listings: list[Listing] = []

    def claim(self, folder: Path) -> None:
        """Count ``folder`` (a split folder listed by the caller) as walked, so that no
        link leads back into it."""
        self._walked.add(os.path.realpath(folder))

    def add(self, listing: Listing, folder: Path, tag: int, *, follow: bool = True) -> None:
        """Walk ``folder`` now, or later if it is a link (``follow=False``: walk it now
        even so, e.g. a split folder that is a link)."""
        if listing not in self._listings:
            self._listings.append(listing)
        source = folder.relative_to(self.root).as_posix()
        if follow and folder.is_symlink():
            link = _Link(listing, source, str(folder), os.path.realpath(folder.parent), tag)
            self._dir_links.append(link)
        else:
            self._walk(listing, str(folder), source, os.path.realpath(folder), tag)

    def finish(self) -> None:
        """Follow the links met so far (and those met while following them)."""
        while self._dir_links:
            links, self._dir_links = self._dir_links, []
            for link, target in sorted(
                ((link, link.target) for link in links), key=lambda lt: (lt[1].count(os.sep), lt[0].source)
            ):
                self._follow(link, target)
        taken: dict[str, str] = {}
        for link in self._file_links:
            self._take_file(link, taken)
        for listing in self._listings:
            if listing.followed_links:
                listing.images.sort(key=lambda item: walk_order(item[0]))

    def _walk(self, listing: Listing, path: str, source: str, real: str, tag: int) -> None:
        """List the real directory ``real`` (reached as ``path``) and those below it, top-down."""
        stack = [(path, source, real)]
        while stack:
            path, source, real = stack.pop()
            if real in self._walked:
                continue
            self._walked.add(real)
            try:
                entries = list_dir(path)
            except OSError as e:
                self._unlisted.add(real)
                self._cannot_list(listing, source, e)
                continue
            subdirs = []
            for entry in entries:
                name = f"{source}/{entry.name}"
                if entry.is_symlink():
                    self._met_link(listing, entry, name, real, tag)
                elif entry.is_dir():
                    subdirs.append((entry.path, name, f"{real}/{entry.name}"))
                else:
                    self._met_file(listing, entry.name, name, tag)
            stack.extend(reversed(subdirs))

    def _met_file(self, listing: Listing, name: str, source: str, tag: int) -> None:
        if self._is_image(name):
            listing.images.append((source, tag))
        elif name not in self._uncounted:
            listing.ignored += 1

    def _met_link(self, listing: Listing, entry: os.DirEntry[str], source: str, parent: str, tag: int) -> None:
        link = _Link(listing, source, entry.path, parent, tag)
        if entry.is_dir():
            self._dir_links.append(link)
        elif self._is_image(entry.name):
            self._file_links.append(link)
        else:
            self._met_file(listing, entry.name, source, tag)

    def _cannot_list(self, listing: Listing, source: str, error: OSError) -> None:
        reason = f"cannot list directory: {error.strerror or error}"
        if self.on_error == "fail":
            raise DataError(f"{self.root / source}: {reason}") from error
        listing.unlisted.append((source, reason))

    def _covered(self, target: str) -> str | None:
        """A walked directory that is ``target`` or lies below it."""
        if target in self._walked:
            return target
        prefix = target.rstrip(os.sep) + os.sep
        return min((w for w in self._walked if w.startswith(prefix)), default=None)

    def _follow(self, link: _Link, target: str) -> None:
        covered = self._covered(target)
        if covered is None:
            link.listing.followed_links += 1
            self._walk(link.listing, link.path, link.source, target, link.tag)
            return
        if link.parent == target or link.parent.startswith(target.rstrip(os.sep) + os.sep):
            reason = f"loop: points at {self._shown(target)}, which holds the link"
        elif covered == target:
            reason = f"points at {self._shown(target)}, already walked"
        else:
            reason = f"points at {self._shown(target)}, above {self._shown(covered)}, already walked"
        link.listing.skipped_links.append((link.source, reason))

    def _take_file(self, link: _Link, taken: dict[str, str]) -> None:
        target = link.target
        folder = os.path.dirname(target)
        if (
            folder in self._walked
            and folder not in self._unlisted
            and os.path.isfile(target)
            and self._is_image(os.path.basename(target))
        ):
            link.listing.skipped_links.append((link.source, f"points at {self._shown(target)}, already listed"))
        elif target in taken:
            link.listing.skipped_links.append((link.source, f"points at the same file as {taken[target]}"))
        else:
            taken[target] = link.source
            link.listing.images.append((link.source, link.tag))
            link.listing.followed_links += 1

    def _shown(self, real: str) -> str:
        """``real`` as ``SRC/...`` when it lies inside SRC, else absolute."""
        root = os.path.realpath(self.root)
        if real == root:
            return "SRC"
        return "SRC/" + real[len(root) + 1 :] if real.startswith(root + os.sep) else real
