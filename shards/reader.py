"""The one reader of the shard format (:mod:`shards.layout`): sample bytes read out of
the tars through each split's index. The daemon, ``feeder verify`` and the benchmarks
read shards only through this package; :mod:`shards.writers` is its counterpart.

:class:`ShardDataset` opens a shard directory (the manifest and the indexes, checked
by :mod:`shards.manifest` and :mod:`shards.index`); each split is a :class:`SplitIndex`,
which reads sample bytes from the tars (:mod:`shards.tars`). :mod:`shards.members`
lists the members of the tars, ``.idx`` files and LMDB values.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import numpy as np

from core.errors import DataError, Located, SampleCorrupt, SamplesUnreadable, Unreadable
from shards.digests import manifest_sha256
from shards.index import IndexColumns, check_split_shards, read_columns
from shards.jpeg import dct_denominator
from shards.layout import sample_checksum
from shards.manifest import Manifest, read_manifest
from shards.objects import ObjectUrl, is_remote
from shards.ranged import RemoteAccess, RemoteShards, RequestPool, cache_entries
from shards.remote_root import RemoteRoot
from shards.sources import Extent, Got, LocalTars, ShardBytes
from shards.store import ObjectStore
from shards.tars import DEFAULT_RECHECK_S

__all__ = [
    "ShardDataset",
    "SplitIndex",
    "Windows",
    "half_boxes",
]


class Windows(NamedTuple):
    """What :meth:`SplitIndex.read_windows` read: encoded bytes per sample, int32
    ``[N, 4]`` windows in those bytes' pixels, and which samples' bytes are their
    half-scale copies (bool ``[N]``)."""

    jpegs: list[np.ndarray]
    boxes: np.ndarray
    from_copies: np.ndarray


class SplitIndex:
    """One split: per-sample key, label, image size and location, and the bytes
    behind them. ``widths`` / ``heights`` (pixels, as stored) let crop windows be
    drawn before anything is decoded.

    Sample bytes are read with ``pread`` into fresh buffers, never sliced from a
    memory map: a tar that is truncated while it is served (``cp`` over it, ``rsync
    --inplace``, a network file system losing it) then gives a short read, raised as
    a :class:`DataError` naming the tar and the sample, instead of a SIGBUS that would
    end the whole process. Where the index has checksums (version 3), every read is
    checked against them: bytes changed in place (same size) are a
    :class:`SampleCorrupt`, never served, and bytes put back read again at once. A tar
    changed under its name (another file, or the same one written) is noticed and
    reopened (:meth:`shard_generation`). Thread-safe for reads; tars are opened on
    first use.

    Args:
        root: the shard directory.
        split: the split's name.
        columns: its index (:func:`shards.index.read_columns`).
        recheck_s: the most time between two looks at a served tar's path.
        source: where the bytes come from (None: the local tars under ``root``).
        allowed_links: directories outside ``root`` its tars' links may lead to.
    """

    def __init__(self, root: Path | ObjectUrl, split: str, columns: IndexColumns,
                 recheck_s: float = DEFAULT_RECHECK_S, source: ShardBytes | None = None,
                 allowed_links: tuple[Path, ...] = ()) -> None:
        self.root = root
        self.split = split
        self.keys = columns.keys
        self.labels = columns.labels
        self.widths = columns.widths
        self.heights = columns.heights
        self.index_version = columns.version
        self.index_sha256 = columns.sha256
        self._cols = columns
        self._shards = columns.shards
        # Samples whose half-scale copy did not decode: read from the image instead.
        self._copy_usable = columns.half_sizes > 0
        self._shard_ids = {shard: i for i, shard in enumerate(self._shards)}
        if source is None:
            if not isinstance(root, Path):
                raise TypeError(f"{root}: a remote split needs its source")
            source = LocalTars(root, self._shards, recheck_s, allowed_links)
        self._bytes = source
        # Reads not served from the page cache alone (disk, a store, or unknown), all
        # threads together: what read-ahead can help (see ``will_need``).
        self.uncached_reads = 0

    def __len__(self) -> int:
        return len(self.keys)

    @property
    def shard_paths(self) -> list[Path | Located]:
        """The split's tars (paths, or URLs of objects), in the order the index first names them."""
        return [self._bytes.where(i) for i in range(len(self._shards))]

    def shard_of(self, index: int) -> str:
        """The tar holding sample ``index``, relative to the shard directory."""
        return self._shards[int(self._cols.shard_ids[index])]

    def tar(self, index: int) -> Path | Located:
        """The tar (path, or URL of an object) holding sample ``index``."""
        return self._bytes.where(int(self._cols.shard_ids[index]))

    def location(self, index: int, half: bool = False) -> tuple[int, int]:
        """(offset, size) of sample ``index``'s JPEG bytes inside its tar (``half``:
        of its half-scale copy; size 0 where it has none)."""
        if half:
            return int(self._cols.half_offsets[index]), int(self._cols.half_sizes[index])
        return int(self._cols.offsets[index]), int(self._cols.sizes[index])

    @property
    def half_copies(self) -> np.ndarray:
        """bool ``[N]``: the sample has a half-scale copy (``feeder shard --half-copies``)."""
        return self._cols.half_sizes > 0

    def read(self, index: int, half: bool = False) -> np.ndarray:
        """Encoded bytes of sample ``index`` (a new uint8 array); ``half``: of its
        half-scale copy.

        Raises:
            SampleCorrupt: the bytes differ from their checksum in the index (a
                :class:`DataError` with the tar, key and index as fields).
            SamplesUnreadable: a store refuses the bytes for good (the object is
                gone, access is denied, it is shorter than the index says).
            DataError: the tar is missing or shorter than the index says (names the
                tar and the sample key). A read that comes up short or fails its
                checksum first looks at the tar's path: a tar changed under its name
                is reopened and the read tried once more there.
            ServiceUnavailable: a store that did not answer for as long as its
                retries last.
        """
        return self.read_many([index], None if not half else np.array([True]))[0]

    def _extent(self, index: int, half: bool) -> Extent:
        offset, size = self.location(index, half)
        shard = int(self._cols.shard_ids[index])
        if size <= 0:
            raise DataError(f"{self._bytes.where(shard)}: sample {self.keys[index]} has no half-scale copy")
        return Extent(shard, offset, size)

    def _checked(self, index: int, half: bool, extent: Extent, got: Got) -> np.ndarray:
        """The bytes of ``got`` once they are whole and match their checksum, looked
        for again where they are not."""
        while not (got.done == extent.size and self._intact(got.data, index, half)):
            again = self._bytes.reread(extent, got)
            if again is None or again.refused is not None:
                break
            got = again
        else:
            return got.data
        path, (offset, size) = self._bytes.where(extent.shard), extent[1:]
        if got.done == size:
            raise SampleCorrupt(path, self.keys[index], index, half)
        raise DataError(
            f"{path}: truncated while in use, sample {self.keys[index]} (bytes {offset}..{offset + size}) cut short"
        )

    def _intact(self, data: np.ndarray, index: int, half: bool) -> bool:
        """True when ``data`` match their checksum in the index, or it has none."""
        checksums = self._cols.half_checksums if half else self._cols.checksums
        return checksums is None or sample_checksum(data) == int(checksums[index])

    def shard_generation(self, shard: str) -> int:
        """How many times tar ``shard`` (relative to the shard directory, as
        :meth:`shard_of` names it) was found changed under its name and reopened: 0
        until then. A caller that remembers something about a tar's samples (those
        that failed to decode) keeps the generation it saw, and forgets when it moves
        on. A tar's path is looked at by reads, at most once per ``recheck_s``, and at
        once by a read that comes up short or fails its checksum.

        Raises:
            KeyError: not a tar of this split.
        """
        return self._bytes.generation(self._shard_ids[shard])

    def look_at(self, shard: str) -> None:
        """Look at tar ``shard``'s path now if ``recheck_s`` has passed since the last
        look (as a read does): for callers that stopped reading a tar, whose memory of
        it should still follow a change (its bad samples, once it is put right).

        Raises:
            DataError: the tar was never opened and cannot be (names it).
        """
        self._bytes.look_at(self._shard_ids[shard])

    def on_shard_changed(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(shard)`` each time a tar of this split is found changed
        (:meth:`shard_generation` has moved on), in the reading thread, right after
        the tar is reopened; it should be quick, and what it raises reaches that read."""
        self._bytes.on_changed(listener)

    def read_many(self, indices: Sequence[int] | np.ndarray, half: np.ndarray | None = None) -> list[np.ndarray]:
        """:meth:`read` for each index, in order (``half[k]``: the copy of the k-th),
        fetched together (from a store: grouped by shard, neighbouring ranges in one
        request).

        Raises:
            SampleCorrupt, DataError: as :meth:`read`, for the first sample that fails.
            SamplesUnreadable: every sample of the batch a store refuses, once the
                others are read.
            ServiceUnavailable: as :meth:`read`.
        """
        rows = [int(i) for i in indices]
        halves = [False] * len(rows) if half is None else [bool(h) for h in half]
        extents = [self._extent(i, h) for i, h in zip(rows, halves)]
        fetched = self._bytes.read(extents)
        self.uncached_reads += sum(not got.cached for got in fetched)
        found, refused = [], []
        for i, h, extent, got in zip(rows, halves, extents, fetched):
            if got.refused is not None:
                refused.append(Unreadable(str(self._bytes.where(extent.shard)), self.keys[i], i, h, got.refused))
            else:
                found.append(self._checked(i, h, extent, got))
        if refused:
            raise SamplesUnreadable(refused)
        return found

    def read_windows(self, indices: Sequence[int] | np.ndarray, boxes: np.ndarray, image_size: int) -> Windows:
        """The bytes to decode each sample's crop window from, and the windows in
        those bytes' pixels: the half-scale copy where the sample has one (that has
        not failed to decode, :meth:`drop_copies`) and its window is at least twice
        ``image_size`` on both sides (where the full image would be decoded at DCT
        scale 1/2 or less anyway), else the image itself.

        Args:
            indices: the samples.
            boxes: int ``[N, 4]`` windows (x, y, width, height) in the image's pixels.
            image_size: the output side they are resized to.

        Raises:
            SampleCorrupt, DataError: as :meth:`read`, for the first sample that fails.
        """
        rows = np.asarray(indices, dtype=np.int64)
        boxes = np.asarray(boxes).astype(np.int32)
        twice = np.array([dct_denominator(int(w), int(h), image_size) >= 2 for w, h in boxes[:, 2:]], dtype=bool)
        half = self._copy_usable[rows] & twice.reshape(len(rows))
        if half.any():
            boxes = boxes.copy()
            boxes[half] = half_boxes(boxes[half], self.widths[rows[half]], self.heights[rows[half]])
        return Windows(self.read_many(rows, half), boxes, half)

    def drop_copies(self, indices: Sequence[int] | np.ndarray) -> None:
        """Read these samples' windows from their images from now on (their half-scale
        copies failed to decode; the images may still)."""
        self._copy_usable[np.asarray(indices, dtype=np.int64)] = False

    def will_need(self, indices: Sequence[int] | np.ndarray) -> None:
        """Start fetching these samples now, without waiting (the kernel's read-ahead
        of local tars; ranged GETs from a store), so the reader stays ahead of the
        pipeline on a cold page cache or a remote root."""
        extents = []
        for i in indices:  # the images: a half-scale copy lies right after its image
            offset, size = self.location(int(i))
            size = max(size, int(self._cols.half_offsets[i] + self._cols.half_sizes[i]) - offset)
            extents.append(Extent(int(self._cols.shard_ids[i]), offset, size))
        self._bytes.will_need(extents)


def half_boxes(boxes: np.ndarray, widths: np.ndarray, heights: np.ndarray) -> np.ndarray:
    """Windows ``(x, y, width, height)`` of images ``widths x heights`` as windows of
    their half-scale copies (``ceil(width / 2) x ceil(height / 2)``): edges halved,
    an odd edge moved out by half a pixel of the copy, clipped to the copy."""
    x, y, w, h = (boxes[:, i].astype(np.int64) for i in range(4))
    x0, y0 = x // 2, y // 2
    x1 = np.minimum((x + w + 1) // 2, (np.asarray(widths, dtype=np.int64) + 1) // 2)
    y1 = np.minimum((y + h + 1) // 2, (np.asarray(heights, dtype=np.int64) + 1) // 2)
    return np.stack([x0, y0, x1 - x0, y1 - y0], axis=1).astype(np.int32)


@dataclass(frozen=True)
class ShardDataset:
    """A named shard directory with its splits.

    Attributes:
        name: the name clients ask for.
        root: the shard directory.
        classes: class names; label ``i`` is ``classes[i]``.
        splits: split name -> index.
        manifest_sha256: the manifest's identity (sha256 of its canonical JSON): two
            daemons serve the same samples, labels and pixels when it is the same.
    """

    name: str
    root: Path | ObjectUrl
    classes: list[str]
    splits: dict[str, SplitIndex]
    manifest_sha256: str = ""

    @classmethod
    def open(cls, name: str, root: Path | str | ObjectUrl, recheck_s: float = DEFAULT_RECHECK_S,
             remote: RemoteAccess | None = None, allowed_links: tuple[Path, ...] = ()) -> ShardDataset:
        """Open and check ``root`` (the manifest and the indexes; no sample is read).

        Args:
            name: the name clients ask for.
            root: the shard directory: a path, or the URL of one in an object store
                (``s3://bucket/prefix``, see :mod:`shards.objects`).
            recheck_s: the most time between two looks at a served tar's path (see
                :meth:`SplitIndex.shard_generation`).
            remote: how a remote root is read (store options, node-local cache,
                requests in flight); the defaults where None.
            allowed_links: directories outside a local root that its links may
                lead to (``--allow-shard-links``); a tar leading anywhere else is
                refused (:mod:`shards.beneath`).

        Raises:
            NotFound: the directory, bucket or manifest does not exist.
            DataError: the manifest or an index is unreadable, of the wrong shape
                (valid JSON but not an object, a field of another type) or
                inconsistent (a label past the manifest's classes), or a tar leads
                outside the root; names the file.
            Unauthenticated: the store refused the credentials.
            ServiceUnavailable: the store cannot be reached.
        """
        if isinstance(root, ObjectUrl) or is_remote(root):
            url = root if isinstance(root, ObjectUrl) else ObjectUrl.parse(str(root))
            return cls._open_remote(name, url, remote or RemoteAccess(), recheck_s)
        root = Path(root)
        manifest = read_manifest(root)
        classes = list(manifest.classes)
        splits = {}
        for split, info in manifest.splits.items():
            check_split_shards(root, split, info)
            columns = read_columns(root, split, info, len(classes), allowed_links)
            splits[split] = SplitIndex(root, split, columns, recheck_s, allowed_links=allowed_links)
        return cls._checked(name, root, manifest, splits)

    @classmethod
    def _open_remote(cls, name: str, url: ObjectUrl, remote: RemoteAccess, recheck_s: float) -> ShardDataset:
        """The same checks as a local root's, through the store's listings (see
        :mod:`shards.remote_root`); one request pool for the dataset's splits."""
        store = ObjectStore(url, remote.options, remote.counters, remote.stopping)
        top = RemoteRoot(store).path()
        manifest = read_manifest(top)
        classes = list(manifest.classes)
        pool = RequestPool(remote.max_requests, f"feeder-get-{name}")
        splits = {}
        for split, info in manifest.splits.items():
            check_split_shards(top, split, info)
            columns = read_columns(top, split, info, len(classes))
            entries = cache_entries(url, info, columns.shards, checked=columns.checksums is not None)
            source = RemoteShards(store, columns.shards, entries, remote.cache, pool, remote.heal_s, recheck_s)
            splits[split] = SplitIndex(url, split, columns, recheck_s, source)
        return cls._checked(name, url, manifest, splits)

    @classmethod
    def _checked(cls, name: str, root: Path | ObjectUrl, manifest: Manifest,
                 splits: dict[str, SplitIndex]) -> ShardDataset:
        """The dataset, with the digest of its manifest as its identity (its JSON,
        every key it holds, with sorted keys)."""
        return cls(name=name, root=root, classes=list(manifest.classes), splits=splits,
                   manifest_sha256=manifest_sha256(manifest))

