"""``feeder verify OUT``: check a shard directory against its manifest.

Checks sizes and sha256 of every tar (and LMDB) and of each index, that the ``.idx``
files and the Parquet index agree with the tar members, the counts per split and per
class, and decodes a seeded sample of the images and their half-scale copies
(``full=True``: every image), each first compared with its checksum in the index.

Each real problem is one line naming the file and, where there is one, the sample:
a tar whose checksum differs has every sample checked to find the damaged one, and
a damaged member header costs that member only (the tar walk resumes after it).

A shard directory in an object store (``feeder verify s3://bucket/prefix``) is
checked by the same code through :class:`shards.remote_root.ObjectPath`: sizes
from the store's listings, and each file downloaded once into a temporary folder
(at most 2 GiB kept at once) for its checksum and its members; problems name URLs.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from PIL import Image
from tqdm import tqdm

from core.errors import DataError
from sharder.config import VerifyConfig, progress_shown
from sharder.images import DEFAULT_MAX_PIXELS, decoded_size, parse_jpeg_header
from shards.index import read_index
from shards.layout import sample_checksum
from shards.manifest import LmdbEntry, Manifest, Root, ShardEntry, SplitEntry, read_manifest
from shards.members import TarScan, idx_members, label_offset, read_lmdb_sample, scan_tar
from shards.objects import ObjectUrl
from shards.remote_root import RemoteRoot
from shards.store import ObjectStore, StoreOptions
from shards.writers import file_sha256

__all__ = ["VerifyResult", "verify"]

SAMPLE_PER_SPLIT = 64  # images decoded per split without --full
_BLOCK = 512  # tar header size
_HALF_SUFFIX = ".half.jpg"  # a sample's half-scale copy (--half-copies)


@dataclass
class VerifyResult:
    """What was checked and what is wrong."""

    root: Root
    problems: list[str] = field(default_factory=list)
    samples: int = 0
    files: int = 0
    decoded: int = 0

    def summary(self) -> str:
        state = "OK" if not self.problems else f"{len(self.problems)} problem(s)"
        return (f"verified {self.root}: {self.samples} samples, {self.files} files, "
                f"{self.decoded} images decoded: {state}")


@dataclass
class _Shard:
    """What the file checks learned about one tar of a split."""

    path: Root
    scan: TarScan | None = None  # None: missing, truncated or unreadable (already reported)
    sha_differs: bool = False  # its damage is named per sample, or once at the end
    named: int = 0  # problems already reported against samples of this shard

    def problem(self, key: str, what: str) -> str:
        self.named += 1
        changed = "sha256 differs from the manifest; " if self.sha_differs else ""
        return f"{self.path}: {changed}sample {key}: {what}"


def _check_file(result: VerifyResult, path: Root, size: int, sha256: str) -> str:
    """``ok``, ``sha`` (same size, other bytes), or ``bad`` (missing or other size: reported)."""
    result.files += 1
    if not path.is_file():
        result.problems.append(f"{path}: missing")
        return "bad"
    if path.stat().st_size != size:
        result.problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {size}")
        return "bad"
    return "ok" if file_sha256(Path(os.fspath(path))) == sha256 else "sha"  # a store's object: its local copy


def _check_shard(result: VerifyResult, root: Root, entry: ShardEntry) -> _Shard:
    shard = _Shard(root / entry.path)
    state = _check_file(result, shard.path, entry.bytes, entry.sha256)
    if state == "bad":
        return shard
    shard.sha_differs = state == "sha"
    try:
        shard.scan = scan_tar(shard.path)
    except DataError as e:
        result.problems.append(str(e))
        return shard
    members, damaged = shard.scan.members, shard.scan.damaged
    images = len(members) - sum(name.endswith(_HALF_SUFFIX) for name in members)  # .jpg + .cls per sample
    if not damaged and images != 2 * entry.samples:
        result.problems.append(f"{shard.path}: {images // 2} samples, manifest says {entry.samples}")
    idx_path = root / entry.index
    idx = idx_members(idx_path) if idx_path.is_file() else {}
    if any(idx.get(name) != where for name, where in members.items()) or (not damaged and idx != members):
        result.problems.append(f"{idx_path}: missing or does not match the tar members")
    return shard


def _check_counts(result: VerifyResult, split: str, rows: list[dict], manifest: Manifest) -> None:
    entry = manifest.splits[split]
    if entry.accepted + entry.rejected != entry.inputs or len(entry.rejects) != entry.rejected:
        result.problems.append(f"{split}: accepted + rejected != inputs, or rejects not all listed")
    if len(rows) != entry.accepted:
        result.problems.append(f"{split}: index has {len(rows)} rows, manifest says {entry.accepted} accepted")
    counts = np.bincount([r["label"] for r in rows], minlength=len(manifest.classes))
    if counts.tolist() != [entry.per_class.get(c, 0) for c in manifest.classes]:
        result.problems.append(f"{split}: per-class counts in the index differ from the manifest")


def _located(result: VerifyResult, rows: list[dict], shards: dict[str, _Shard]) -> list[dict]:
    """The rows whose JPEG bytes are where the index says; the others are reported
    once each (a damaged member header is named as such, not as a wrong index)."""
    found = []
    for row in rows:
        shard = shards.get(row["shard"])
        if shard is None or shard.scan is None:
            continue  # a missing or truncated tar is one problem, already reported
        half = shard.scan.members.get(f"{row['key']}{_HALF_SUFFIX}", (-1, 0))
        if half != (row["half_offset"], row["half_size"]) and not shard.scan.damaged:
            result.problems.append(shard.problem(row["key"], f"index row does not locate {row['key']}{_HALF_SUFFIX}"))
        if shard.scan.members.get(f"{row['key']}.jpg") == (row["offset"], row["size"]):
            found.append(row)
        elif shard.scan.damage_within(row["offset"] - _BLOCK, row["offset"] + row["size"]):
            result.problems.append(shard.problem(row["key"], "its tar member header is damaged (bad checksum)"))
        else:
            result.problems.append(shard.problem(row["key"], f"index row does not locate {row['key']}.jpg"))
    return found


def _decode(data: bytes, label_text: bytes | None, row: dict, max_pixels: int) -> str | None:
    """What is wrong with one stored sample, or None."""
    header = parse_jpeg_header(data)
    if header is not None and header.width * header.height > max_pixels:
        return f"image is {header.width}x{header.height}, over the {max_pixels:,}-pixel limit (not decoded)"
    try:
        size = decoded_size(data)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        return f"image does not decode: {e}"
    if size != (row["width"], row["height"]):
        return f"image is {size[0]}x{size[1]}, index says {row['width']}x{row['height']}"
    if label_text is not None and label_text != str(row["label"]).encode():
        return f"label {label_text!r} differs from index label {row['label']}"
    return None


def _decode_half(data: bytes, row: dict) -> str | None:
    """What is wrong with a sample's half-scale copy (``data``), or None."""
    expected = ((row["width"] + 1) // 2, (row["height"] + 1) // 2)
    try:
        size = decoded_size(data)
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:
        return f"half-scale copy does not decode: {e}"
    if size != expected:
        return f"half-scale copy is {size[0]}x{size[1]}, expected {expected[0]}x{expected[1]}"
    return None


def _checksum_problem(data: bytes, half: bytes, row: dict) -> str | None:
    """What differs from the index's checksums (index version 3), or None: nothing
    does, or the index has none."""
    image = row["checksum"] is not None and sample_checksum(data) != row["checksum"]
    copy = row["half_size"] > 0 and row["half_checksum"] is not None and sample_checksum(half) != row["half_checksum"]
    if image and copy:
        return "image and half-scale copy differ from their checksums in the index"
    if image or copy:
        return f"{'image' if image else 'half-scale copy'} differs from its checksum in the index"
    return None


def _decode_sample(
    result: VerifyResult, root: Root, rows: list[dict], shards: dict[str, _Shard], max_pixels: int
) -> None:
    for row in rows:
        with open(root / row["shard"], "rb") as f:
            f.seek(row["offset"])
            data = f.read(row["size"])
            f.seek(label_offset(row["offset"], row["size"]))
            label = f.read(len(str(row["label"])) + 1).rstrip(b"\0")
            half = b""
            if row["half_size"] > 0:
                f.seek(row["half_offset"])
                half = f.read(row["half_size"])
        problem = _checksum_problem(data, half, row) or _decode(data, label, row, max_pixels)
        if problem is None and row["half_size"] > 0:
            problem = _decode_half(half, row)
        result.decoded += problem is None
        if problem is not None:
            result.problems.append(shards[row["shard"]].problem(row["key"], problem))


def _decode_lmdb(result: VerifyResult, lmdb_path: Root, rows: list[dict], max_pixels: int) -> None:
    with lmdb.open(os.fspath(lmdb_path), readonly=True, lock=False) as env:
        for row in rows:
            data, label_number = read_lmdb_sample(env, row["key"])
            problem = _checksum_problem(data, b"", row) or _decode(data, str(label_number).encode(), row, max_pixels)
            result.decoded += problem is None
            if problem is not None:
                result.problems.append(f"{lmdb_path}: sample {row['key']}: {problem}")


def _check_lmdb(result: VerifyResult, root: Root, entry: LmdbEntry) -> None:
    path = root / entry.path
    state = _check_file(result, path / "data.mdb", entry.bytes, entry.sha256)
    if state == "sha":
        result.problems.append(f"{path / 'data.mdb'}: sha256 differs from the manifest")
    elif state == "ok":
        with lmdb.open(os.fspath(path), readonly=True, lock=False) as env:
            if env.stat()["entries"] != entry.samples:
                result.problems.append(f"{path}: {env.stat()['entries']} entries, manifest says {entry.samples}")


def _index_rows(result: VerifyResult, root: Root, split: str, entry: SplitEntry) -> list[dict] | None:
    """The split's index rows, or None (reported once) when the index is missing,
    unreadable or not the one the manifest records: its rows cannot be trusted."""
    index_file = root / entry.index
    if not index_file.is_file():
        result.problems.append(f"{index_file}: missing")
        return None
    if entry.index_sha256 is not None and file_sha256(Path(os.fspath(index_file))) != entry.index_sha256:
        result.problems.append(f"{index_file}: sha256 differs from the manifest (damaged; its rows were not checked)")
        return None
    try:
        return read_index(root, split).to_pylist()
    except DataError as e:
        result.problems.append(str(e))
        return None


def _check_split(
    result: VerifyResult, root: Root, manifest: Manifest, split: str, full: bool, seed: int, bar: tqdm
) -> None:
    entry = manifest.splits[split]
    shards = {}
    for shard_entry in entry.shards:
        shards[shard_entry.path] = _check_shard(result, root, shard_entry)
        bar.update(1)
    if entry.lmdb is not None:
        _check_lmdb(result, root, entry.lmdb)
    rows = _index_rows(result, root, split, entry)
    if rows is None:
        return
    _check_counts(result, split, rows, manifest)
    result.samples += len(rows)
    max_pixels = int(manifest.options.get("max_pixels") or DEFAULT_MAX_PIXELS)
    if not entry.shards:
        if entry.lmdb is not None:
            _decode_lmdb(result, root / entry.lmdb.path, _sampled(rows, full, seed), max_pixels)
        return
    located = _located(result, rows, shards)
    # Every sample of a tar whose checksum differs is decoded: that names the damaged one.
    suspect = [row for row in located if shards[row["shard"]].sha_differs]
    chosen = {row["key"] for row in _sampled(located, full, seed)} | {row["key"] for row in suspect}
    _decode_sample(result, root, [row for row in located if row["key"] in chosen], shards, max_pixels)
    for shard in shards.values():
        if shard.sha_differs and not shard.named:
            result.problems.append(
                f"{shard.path}: sha256 differs from the manifest (every sample still decodes at its indexed size)"
            )


def _sampled(rows: list[dict], full: bool, seed: int) -> list[dict]:
    if full or len(rows) <= SAMPLE_PER_SPLIT:
        return rows
    picks = np.random.default_rng(seed).choice(len(rows), SAMPLE_PER_SPLIT, replace=False)
    return [rows[i] for i in sorted(picks.tolist())]


def _root(config: VerifyConfig) -> Root:
    """The shard directory: a path, or one in an object store."""
    if isinstance(config.out, str):
        store = ObjectStore(ObjectUrl.parse(config.out), StoreOptions(endpoint_url=config.s3_endpoint))
        return RemoteRoot(store).path()
    return config.out


def verify(config: VerifyConfig | Path | str, **options: Any) -> VerifyResult:
    """Check a shard directory.

    Args:
        config: the directory (``out``, written by ``feeder shard``) and how to check
            it (``full``: every image decoded instead of ``SAMPLE_PER_SPLIT`` per
            split). A path instead is ``VerifyConfig(path, **options)``.
        options: ``full``, ``seed``, ``progress`` of a VerifyConfig, with a path.

    Returns:
        A VerifyResult; ``problems`` is empty when everything matches.

    Raises:
        NotFound: no manifest in the directory (or no such bucket).
        DataError: the manifest is unreadable, of an unknown version or of the wrong
            shape (:func:`shards.manifest.read_manifest`).
        Unauthenticated, ServiceUnavailable: a store refused the credentials or could
            not be reached.
        TypeError: options given with a VerifyConfig.
    """
    if isinstance(config, VerifyConfig) and options:
        raise TypeError("verify: give a VerifyConfig, or a path and its options")
    if not isinstance(config, VerifyConfig):
        config = VerifyConfig(config if isinstance(config, str) else Path(config), **options)
    root = _root(config)
    manifest = read_manifest(root)
    result = VerifyResult(root)
    total = sum(len(entry.shards) for entry in manifest.splits.values())
    with tqdm(total=total, unit="shard", desc="verify", disable=not progress_shown(config.progress)) as bar:
        for split in manifest.splits:
            _check_split(result, root, manifest, split, config.full, config.seed, bar)
    return result
