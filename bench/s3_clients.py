"""S3 client libraries on the reads the daemon makes, against a real S3 server
(SeaweedFS, :mod:`bench.seaweedfs`) it starts on this machine: ranged GETs of 50-150
KB (one sample each: one at a time, and ``--threads`` at once), and whole-object GETs
of a ``--object-mb`` shard (what the node-local shard cache fetches).

Each client reads the same random ranges of the same object; every read is compared
with the bytes written. Reported per client and kind of read: the median of
``--repeats`` runs of reads/s and MB/s, and the client process's CPU seconds per GB
read (the server shares the machine's cores, so a client's CPU is the store's loss).

Clients: ``pyarrow`` (pyarrow.fs.S3FileSystem, a project dependency), ``obstore``
and ``s3torchconnector`` where they import (``pip install obstore s3torchconnector``;
skipped with the reason otherwise).

Usage::

    python bench/s3_clients.py --json s3_clients.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

import numpy as np

if __package__ in (None, ""):  # run as a script: python bench/s3_clients.py
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import write_document  # noqa: E402
from bench.seaweedfs import SeaweedFS, seaweedfs  # noqa: E402
from shards.objects import ObjectUrl  # noqa: E402
from shards.store import ObjectStore, StoreOptions  # noqa: E402

__all__ = ["main"]

_BUCKET = "clients"


class Client(Protocol):
    def read_range(self, key: str, offset: int, size: int) -> bytes: ...

    def read_whole(self, key: str) -> bytes: ...


class PyarrowClient:
    """pyarrow.fs: one RandomAccessFile per object (one HEAD when opened), ``read_at``
    per range; a whole object through an input stream."""

    def __init__(self, server: SeaweedFS, sizes: dict[str, int]) -> None:
        self._fs = server.filesystem()
        self._files = {key: self._fs.open_input_file(f"{_BUCKET}/{key}") for key in sizes}

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        return self._files[key].read_at(size, offset)

    def read_whole(self, key: str) -> bytes:
        with self._fs.open_input_stream(f"{_BUCKET}/{key}", buffer_size=8 << 20) as stream:
            return stream.read()


class ObstoreClient:
    """obstore (Rust object_store): ``get_range`` per range, ``get`` for a whole object."""

    def __init__(self, server: SeaweedFS, sizes: dict[str, int]) -> None:
        import obstore
        from obstore.store import S3Store

        self._obstore = obstore
        self._store = S3Store(_BUCKET, endpoint=server.endpoint_url, access_key_id=server.access_key,
                              secret_access_key=server.secret_key, region=server.region,
                              client_options={"allow_http": True}, virtual_hosted_style_request=False)

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        return bytes(self._obstore.get_range(self._store, key, start=offset, length=size))

    def read_whole(self, key: str) -> bytes:
        return bytes(self._obstore.get(self._store, key).bytes())


class TorchConnectorClient:
    """s3torchconnector (AWS CRT): a range-based reader per object and thread (readers
    are not thread-safe), ``seek`` + ``read`` per range; a sequential reader for a
    whole object."""

    def __init__(self, server: SeaweedFS, sizes: dict[str, int]) -> None:
        from s3torchconnector import S3ClientConfig, S3ReaderConstructor
        from s3torchconnector._s3client import S3Client

        os.environ.update(server.environment())
        self._client = S3Client(server.region, endpoint=server.endpoint_url,
                                s3client_config=S3ClientConfig(force_path_style=True))
        self._ranged = S3ReaderConstructor.range_based()
        self._readers = threading.local()

    def read_range(self, key: str, offset: int, size: int) -> bytes:
        readers = self._readers.__dict__
        if key not in readers:
            readers[key] = self._client.get_object(_BUCKET, key, reader_constructor=self._ranged)
        reader = readers[key]
        reader.seek(offset)
        return reader.read(size)

    def read_whole(self, key: str) -> bytes:
        return self._client.get_object(_BUCKET, key).read()


CLIENTS: dict[str, Callable[[SeaweedFS, dict[str, int]], Client]] = {
    "pyarrow": PyarrowClient, "obstore": ObstoreClient, "s3torchconnector": TorchConnectorClient,
}


def _timed(work: Callable[[], int]) -> tuple[float, float, int]:
    """(wall seconds, this process's CPU seconds, bytes) of ``work()``."""
    wall, cpu = time.perf_counter(), time.process_time()
    done = work()
    return time.perf_counter() - wall, time.process_time() - cpu, done


def _ranges(rng: np.random.Generator, count: int, object_bytes: int) -> list[tuple[int, int]]:
    sizes = rng.integers(50_000, 150_001, count)
    return [(int(rng.integers(0, object_bytes - s)), int(s)) for s in sizes]


def _measure(client: Client, data: bytes, args: argparse.Namespace, seed: int) -> dict[str, tuple[float, float, int]]:
    ranges = _ranges(np.random.default_rng(seed), args.reads, len(data))

    def read(r: tuple[int, int]) -> int:
        got = client.read_range("shard", *r)
        if got != data[r[0]:r[0] + r[1]]:
            raise RuntimeError(f"range {r}: wrong bytes")
        return len(got)

    def whole() -> int:
        got = client.read_whole("shard")
        if len(got) != len(data):
            raise RuntimeError("whole object: wrong size")
        return len(got)

    with ThreadPoolExecutor(args.threads) as pool:
        return {
            "ranged_1": _timed(lambda: sum(read(r) for r in ranges[: args.reads // 4])),
            f"ranged_{args.threads}": _timed(lambda: sum(pool.map(read, ranges))),
            "whole": _timed(lambda: sum(whole() for _ in range(2))),
        }


def _summary(runs: list[dict[str, tuple[float, float, int]]], reads: dict[str, int]) -> dict[str, dict[str, float]]:
    found = {}
    for kind in runs[0]:
        walls = [run[kind][0] for run in runs]
        cpu = statistics.median(run[kind][1] / run[kind][2] * 1e9 for run in runs)
        nbytes = runs[0][kind][2]
        found[kind] = {"reads_per_s": round(reads[kind] / statistics.median(walls), 1),
                       "mb_per_s": round(nbytes / statistics.median(walls) / 1e6, 1),
                       "cpu_s_per_gb": round(cpu, 2)}
    return found


def _store_object(server: SeaweedFS, staged: Path, data: bytes) -> None:
    """``data`` as the object ``shard`` of a new bucket, in one PUT as ``feeder shard``
    stores a shard (ranged reads of a multipart object are slower on SeaweedFS)."""
    server.filesystem().create_dir(_BUCKET)
    staged.write_bytes(data)
    os.environ.update(server.environment())
    ObjectStore(ObjectUrl.parse(f"s3://{_BUCKET}"), StoreOptions(endpoint_url=server.endpoint_url)).put_file(
        "shard", staged)


def main(argv: list[str] | None = None) -> dict[str, object]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--object-mb", type=int, default=128, help="size of the object read (a shard)")
    parser.add_argument("--reads", type=int, default=400, help="ranged reads per run (a quarter one at a time)")
    parser.add_argument("--threads", type=int, default=8, help="ranged reads in flight at once")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--clients", default=",".join(CLIENTS))
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    data = np.random.default_rng(0).integers(0, 256, args.object_mb << 20, dtype=np.uint8).tobytes()
    reads = {"ranged_1": args.reads // 4, f"ranged_{args.threads}": args.reads, "whole": 2}
    results: dict[str, object] = {"command": sys.argv, "options": vars(args) | {"json": str(args.json)}}
    with tempfile.TemporaryDirectory() as tmp, seaweedfs(Path(tmp) / "s3") as server:
        _store_object(server, Path(tmp) / "shard", data)
        for name in args.clients.split(","):
            try:
                client = CLIENTS[name](server, {"shard": len(data)})
            except ImportError as e:
                results[name] = {"skipped": f"not installed ({e})"}
                continue
            _measure(client, data, args, seed=99)  # warm-up: connections, the server's caches
            results[name] = _summary([_measure(client, data, args, seed) for seed in range(args.repeats)], reads)
            print(name, json.dumps(results[name]), flush=True)
    if args.json is not None:
        write_document(args.json, results)
    return results


if __name__ == "__main__":
    main()
