"""``feeder verify OUT``: check a shard directory against its manifest.

Checks sizes and sha256 of every tar (and LMDB), that the ``.idx`` files and the
Parquet index agree with the tar members, the counts per split and per class, and
decodes a seeded sample of the images (``full=True``: every image).
"""

from __future__ import annotations

import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import numpy as np
from PIL import Image
from tqdm import tqdm

from core.errors import DataError
from shards.reader import idx_members, label_offset, read_index, read_lmdb_sample, read_manifest, tar_members
from shards.writers import file_sha256

__all__ = ["VerifyResult", "verify"]

SAMPLE_PER_SPLIT = 64  # images decoded per split without --full


@dataclass
class VerifyResult:
    """What was checked and what is wrong."""

    root: Path
    problems: list[str] = field(default_factory=list)
    samples: int = 0
    files: int = 0
    decoded: int = 0

    def summary(self) -> str:
        state = "OK" if not self.problems else f"{len(self.problems)} problem(s)"
        return f"verified {self.root}: {self.samples} samples, {self.files} files, {self.decoded} images decoded: {state}"


def _check_file(result: VerifyResult, path: Path, size: int, sha256: str) -> bool:
    result.files += 1
    if not path.is_file():
        result.problems.append(f"{path}: missing")
        return False
    if path.stat().st_size != size:
        result.problems.append(f"{path}: {path.stat().st_size} bytes, manifest says {size}")
    elif file_sha256(path) != sha256:
        result.problems.append(f"{path}: sha256 differs from the manifest")
    else:
        return True
    return False


def _check_shard(result: VerifyResult, root: Path, entry: dict[str, Any]) -> dict[str, tuple[int, int]]:
    tar_path = root / entry["path"]
    if not _check_file(result, tar_path, entry["bytes"], entry["sha256"]):
        return {}
    try:
        members = tar_members(tar_path)
    except DataError as e:
        result.problems.append(str(e))
        return {}
    if len(members) != 2 * entry["samples"]:
        result.problems.append(f"{tar_path}: {len(members) // 2} samples, manifest says {entry['samples']}")
    idx_path = root / entry["index"]
    if not idx_path.is_file() or idx_members(idx_path) != members:
        result.problems.append(f"{idx_path}: missing or does not match the tar members")
    return members


def _check_rows(result: VerifyResult, split: str, table: Any, members: dict[str, dict], manifest: dict) -> None:
    entry = manifest["splits"][split]
    rows = table.to_pylist()
    if entry["accepted"] + entry["rejected"] != entry["inputs"] or len(entry["rejects"]) != entry["rejected"]:
        result.problems.append(f"{split}: accepted + rejected != inputs, or rejects not all listed")
    if len(rows) != entry["accepted"]:
        result.problems.append(f"{split}: index has {len(rows)} rows, manifest says {entry['accepted']} accepted")
    counts = np.bincount([r["label"] for r in rows], minlength=len(manifest["classes"]))
    if counts.tolist() != [entry["per_class"].get(c, 0) for c in manifest["classes"]]:
        result.problems.append(f"{split}: per-class counts in the index differ from the manifest")
    for row in rows:
        member = members.get(row["shard"], {}).get(f"{row['key']}.jpg")
        if members and member != (row["offset"], row["size"]):
            result.problems.append(f"{split}: index row {row['key']} does not locate {row['shard']}:{row['key']}.jpg")


def _decode(result: VerifyResult, where: str, data: bytes, label_text: bytes | None, row: dict) -> None:
    try:
        with Image.open(io.BytesIO(data)) as image:
            image.load()
            size = image.size
    except (OSError, ValueError, SyntaxError) as e:
        result.problems.append(f"{where}: image does not decode: {e}")
        return
    result.decoded += 1
    if size != (row["width"], row["height"]):
        result.problems.append(f"{where}: image is {size[0]}x{size[1]}, index says {row['width']}x{row['height']}")
    if label_text is not None and label_text != str(row["label"]).encode():
        result.problems.append(f"{where}: label {label_text!r} differs from index label {row['label']}")


def _decode_sample(result: VerifyResult, root: Path, rows: list[dict], lmdb_path: Path | None) -> None:
    env = lmdb.open(str(lmdb_path), readonly=True, lock=False) if lmdb_path else None
    try:
        for row in rows:
            if env is not None:
                data, label_number = read_lmdb_sample(env, row["key"])
                _decode(result, f"{lmdb_path}:{row['key']}", data, str(label_number).encode(), row)
                continue
            with open(root / row["shard"], "rb") as f:
                f.seek(row["offset"])
                data = f.read(row["size"])
                f.seek(label_offset(row["offset"], row["size"]))
                label = f.read(len(str(row["label"])) + 1).rstrip(b"\0")
            _decode(result, f"{row['shard']}:{row['key']}", data, label, row)
    finally:
        if env is not None:
            env.close()


def _check_lmdb(result: VerifyResult, root: Path, entry: dict[str, Any]) -> None:
    path = root / entry["path"]
    if _check_file(result, path / "data.mdb", entry["bytes"], entry["sha256"]):
        with lmdb.open(str(path), readonly=True, lock=False) as env:
            if env.stat()["entries"] != entry["samples"]:
                result.problems.append(f"{path}: {env.stat()['entries']} entries, manifest says {entry['samples']}")


def _check_split(result: VerifyResult, root: Path, manifest: dict, split: str, full: bool, seed: int, bar: tqdm) -> None:
    entry = manifest["splits"][split]
    members = {}
    for shard_entry in entry["shards"]:
        members[shard_entry["path"]] = _check_shard(result, root, shard_entry)
        bar.update(1)
    if "lmdb" in entry:
        _check_lmdb(result, root, entry["lmdb"])
    index_file = root / entry["index"]
    if not index_file.is_file():
        result.problems.append(f"{index_file}: missing")
        return
    try:
        table = read_index(root, split)
    except DataError as e:
        result.problems.append(str(e))
        return
    _check_rows(result, split, table, members if entry["shards"] else {}, manifest)
    result.samples += table.num_rows
    rows = table.to_pylist()
    if not full and len(rows) > SAMPLE_PER_SPLIT:
        picks = np.random.default_rng(seed).choice(len(rows), SAMPLE_PER_SPLIT, replace=False)
        rows = [rows[i] for i in sorted(picks.tolist())]
    if result.problems:
        return  # offsets are not trustworthy; decoding would only repeat the problem
    _decode_sample(result, root, rows, None if entry["shards"] else root / entry["lmdb"]["path"])


def verify(root: Path, *, full: bool = False, seed: int = 0, progress: bool = False) -> VerifyResult:
    """Check the shard directory ``root``.

    Args:
        root: a directory written by ``feeder shard``.
        full: decode every image instead of ``SAMPLE_PER_SPLIT`` per split.
        seed: chooses the decoded sample.
        progress: show a progress bar (shards checked) on stderr.

    Returns:
        A VerifyResult; ``problems`` is empty when everything matches.

    Raises:
        NotFound: no manifest in ``root``.
        DataError: the manifest is unreadable or of an unknown version.
    """
    root = Path(root)
    manifest = read_manifest(root)
    result = VerifyResult(root)
    total = sum(len(entry["shards"]) for entry in manifest["splits"].values())
    with tqdm(total=total, unit="shard", desc="verify", disable=not progress) as bar:
        for split in manifest["splits"]:
            _check_split(result, root, manifest, split, full, seed, bar)
    return result
