"""What checking a split's index against the manifest's ``index_sha256`` costs a
daemon's start, on an index of ImageNet's size (1,281,167 samples over 1,024 shards,
keys and sizes as the sharder writes them): the sha256 of the file (read in 1 MiB
pieces, so memory stays flat) beside reading its columns, median of repeats.

    .venv/bin/python -m bench.index_check [--samples N] [--repeats R] [--out bench/results/index-check.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np

from bench.report import git_revision
from shards.index import read_columns
from shards.layout import INDEX_VERSION, file_sha256, index_path
from shards.manifest import SplitEntry
from shards.writers import write_index

_IMAGENET_TRAIN = 1_281_167


def _write(root: Path, samples: int) -> Path:
    rng = np.random.default_rng(0)
    shards = 1024
    per_shard = -(-samples // shards)
    shard_of = np.arange(samples) // per_shard
    sizes = rng.integers(40_000, 160_000, samples)
    offsets = np.zeros(samples, dtype=np.int64)
    for s in range(shards):  # each sample after the one before it in its tar, behind a 512-byte header
        mine = shard_of == s
        offsets[mine] = np.cumsum(sizes[mine] + 1024) - sizes[mine]
    columns = {
        "key": [f"n{c:08d}_{i:07d}" for i, c in enumerate(rng.integers(0, 1000, samples))],
        "label": rng.integers(0, 1000, samples).tolist(),
        "shard": [f"train/shard-{s:06d}.tar" for s in shard_of],
        "offset": offsets.tolist(), "size": sizes.tolist(),
        "source": [f"train/n{c:08d}/img_{i}.JPEG" for i, c in enumerate(rng.integers(0, 1000, samples))],
        "width": rng.integers(200, 900, samples).tolist(), "height": rng.integers(200, 900, samples).tolist(),
        "half_offset": [-1] * samples, "half_size": [0] * samples,
        "checksum": rng.integers(0, 2**62, samples).tolist(), "half_checksum": [0] * samples,
    }
    path = index_path(root, "train")
    path.parent.mkdir(parents=True)
    write_index(path, columns, INDEX_VERSION)
    for s in range(shards):  # the reader checks every sample lies inside its tar: sparse files of the right size
        end = int((offsets[shard_of == s] + sizes[shard_of == s]).max(initial=0))
        with open(root / f"train/shard-{s:06d}.tar", "wb") as f:
            f.truncate(end)
    return path


def _median_s(run, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=_IMAGENET_TRAIN)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        path = _write(root, args.samples)
        digest = file_sha256(path)
        info = SplitEntry(num_samples=args.samples, accepted=args.samples, rejected=0, ignored=0,
                          inputs=args.samples, per_class={}, index="train/index.parquet", shards=(), rejects=(),
                          index_sha256=digest)
        sha_s = _median_s(lambda: file_sha256(path), args.repeats)
        read_s = _median_s(lambda: read_columns(root, "train", info, 1000), args.repeats)
        result = {"revision": git_revision(), "samples": args.samples, "index_bytes": path.stat().st_size,
                  "sha256_s": round(sha_s, 4), "read_columns_s": round(read_s, 4),
                  "sha256_share_of_read": round(sha_s / read_s, 3), "repeats": args.repeats}
    print(json.dumps(result, indent=2))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
