"""Transport-only benchmark: GB/s of a pre-made uint8 batch from a daemon process to
a client process, no decoding, beside a plain memcpy of the same bytes.

Paths, each a real gRPC stream over loopback from a server process:

- ``shm``: the shared-memory ring (producer copies the batch into a slot, client
  wraps it and drops it, the slot returns through ``ReleaseSlots``);
- ``grpc``: the new gRPC payload (producer writes into the message, raw
  deserializer, tensor is a view of the received bytes);
- ``today``: the path before the transport package, kept here as the baseline (the
  producer's write into an array of its own, as DALI's ``as_array`` was;
  ``encode_before`` of ``bench/transport_server.py``: protobuf head + pixels joined
  into one bytes;
  ``_to_host_before``: ``Batch.FromString`` + a copy into a fresh tensor);
- ``ceiling``: grpcio's own ceiling for messages of this size: the server yields one
  serialized ``Batch`` made once, again and again, and the client only counts the
  bytes it receives (no producer copy, no parse, no tensor; malloc set as the gRPC
  payload sets it): what no gRPC payload through grpcio can beat on this machine;
- ``memcpy``: ``np.copyto`` of the same bytes into as many buffers as the ring has
  slots, in one process (upper bound);
- ``shm-guard`` and ``grpc-guard``: ``shm`` and ``grpc`` with the same handlers, the
  same batches and the same client, the thread-per-call server behind the daemon's
  ``feeder.call_guard.CallGuard`` (every call read as request-streaming, its request
  through the gate and deadline of calls waiting for it): what the guard costs;
- ``shm-aio`` and ``grpc-aio``: the same again, served by a ``grpc.aio`` server (the
  handlers, plain generators as the daemon's servicer is, run in its thread pool),
  where a call waiting for its request holds no thread: what serving the daemon
  from ``grpc.aio`` instead would cost or gain.

As in the daemon, a producer thread writes each batch (the pipeline's output: a copy
of the pre-made batch) ahead of the gRPC handler through a queue of 4, while the
handler makes and sends the messages of the batches before (``produced`` in
``bench/transport_server.py``, the server process).

Each repeat of each path runs in a client process of its own, against a server
process of its own (memcpy: one process), started for it: what a process did before
changes what it measures. The gRPC payload changes malloc's settings in the
processes it runs in (``transport.heap``, for messages over 32 MiB), which the path
before did not; a channel that carried 64-image batches first moved 256-image ones
at 1.3 GB/s where a fresh one moves 1.8-2.4; and shared memory against memcpy,
measured in one long-lived process, came out between 0.44x and 0.55x at batch 64
depending on what that process had run before.

Usage: ``python bench/transport_only.py [--batch-sizes 64 256] [--json out.json]``.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:  # run as a script from anywhere
    sys.path.insert(0, str(_ROOT))

import grpc  # noqa: E402
import torch  # noqa: E402

from bench.report import write_json  # noqa: E402
from bench.transport_server import AIO, CEILING, GUARD, TODAY, UNLIMITED, BenchConfig, premade, serve  # noqa: E402
from protos import feeder_pb2  # noqa: E402
from transport.heap import fit_messages  # noqa: E402

_PATHS = ("memcpy", "shm", "grpc", TODAY, CEILING, *(f"{p}{s}" for s in (GUARD, AIO) for p in ("shm", "grpc")))


def _to_host_before(message: feeder_pb2.Batch) -> torch.Tensor:
    """How the loader turned a parsed ``Batch`` into a host tensor before: a copy of
    the ``images`` field into a fresh tensor."""
    shape = tuple(message.shape)
    images = torch.empty(shape, dtype=torch.uint8)
    images.numpy()[...] = np.frombuffer(message.images, dtype=np.uint8).reshape(shape)
    return images


def _server_of(path: str) -> tuple[str, str]:
    """(the path, the server suffix: "", ``GUARD`` or ``AIO``)."""
    for suffix in (GUARD, AIO):
        if path.endswith(suffix):
            return path.removesuffix(suffix), suffix
    return path, ""


def _stream_rate(channel: grpc.Channel, path: str, config: BenchConfig, batch_size: int, shm_dir: Path) -> float:
    """Bytes/s of one repeat of ``path`` through the server behind ``channel``."""
    from transport.base import HostIdentity
    from transport.client import STREAM_BATCHES, SlotReleaser, StreamReceiver
    from transport.grpc_payload import parse_batch

    path, _ = _server_of(path)  # the same client whichever server
    transports = {"shm": feeder_pb2.TRANSPORT_SHM, "grpc": feeder_pb2.TRANSPORT_GRPC}
    transport = transports.get(path, feeder_pb2.TRANSPORT_AUTO)
    request = feeder_pb2.StreamRequest(
        batch_size=batch_size, max_samples=config.warmup_batches + config.batches, transport=transport,
        job_id=path if path in (TODAY, CEILING) else "",
        client_host=HostIdentity.of_this_process(shm_dir).client_host().to_message(),
    )
    call = channel.unary_stream(STREAM_BATCHES, request_serializer=feeder_pb2.StreamRequest.SerializeToString)
    releaser = SlotReleaser(channel.unary_unary(
        "/feeder.v1.Feeder/ReleaseSlots", request_serializer=feeder_pb2.ReleaseRequest.SerializeToString,
        response_deserializer=feeder_pb2.ReleaseResponse.FromString))
    receiver = StreamReceiver(releaser, shm_dir)
    nbytes, started = 0, 0.0
    for count, data in enumerate(call(request, timeout=600)):
        if count == config.warmup_batches:
            nbytes, started = 0, time.perf_counter()
        if path == CEILING:
            fit_messages(len(data))  # malloc as the gRPC payload sets it
            nbytes += batch_size * config.side_px ** 2 * 3  # the pixels it carries, as the others count
            continue
        if path == TODAY:
            images = _to_host_before(feeder_pb2.Batch.FromString(data))
        else:
            images = receiver.receive(parse_batch(data)).images
            if receiver.kind is None or receiver.kind.name.lower() != path:
                raise RuntimeError(f"asked for {path}, got {receiver.kind}")
        nbytes += images.numel()
        del images  # a CPU consumer done with the batch: its slot goes back
    elapsed = time.perf_counter() - started
    receiver.close()
    releaser.close()
    return nbytes / elapsed


def _memcpy_rate(config: BenchConfig, batch_size: int) -> float:
    """Bytes/s of ``np.copyto`` of the batch into ``ring_slots`` buffers in turn: the
    same copies into the same amount of memory as the shared-memory ring's producer
    makes, in one process and with nothing else (one hot buffer would stay in the
    CPU's cache and measure the cache instead)."""
    source = premade(batch_size, config.side_px)
    targets = [np.zeros_like(source) for _ in range(config.ring_slots)]  # touched: no page faults timed
    for i in range(config.warmup_batches):
        np.copyto(targets[i % len(targets)], source)
    started = time.perf_counter()
    for i in range(config.batches):
        np.copyto(targets[i % len(targets)], source)
    return config.batches * source.nbytes / (time.perf_counter() - started)


def _fresh_rate(config: BenchConfig, path: str, batch_size: int, shm_dir: str, rates: Any) -> None:
    """One repeat of ``path`` from a client process of its own, against a server
    process of its own (both exit after it); puts its bytes/s into ``rates``."""
    if path == "memcpy":
        rates.put(_memcpy_rate(config, batch_size))
        return
    context = mp.get_context("spawn")
    ports: mp.Queue = context.Queue()  # type: ignore[type-arg]
    stop = context.Event()
    server = context.Process(target=serve, args=(config, shm_dir, ports, stop, _server_of(path)[1]), daemon=True)
    server.start()
    try:
        with grpc.insecure_channel(f"127.0.0.1:{ports.get(timeout=120)}", options=UNLIMITED) as channel:
            rates.put(_stream_rate(channel, path, config, batch_size, Path(shm_dir)))
    finally:
        stop.set()
        server.join(30)


def _fresh_process_rate(config: BenchConfig, path: str, batch_size: int, shm_dir: Path) -> float:
    context = mp.get_context("spawn")
    rates: mp.Queue = context.Queue()  # type: ignore[type-arg]
    client = context.Process(target=_fresh_rate, args=(config, path, batch_size, str(shm_dir), rates))
    client.start()
    try:
        return float(rates.get(timeout=600))
    finally:
        client.join(60)


def run(config: BenchConfig) -> list[dict]:
    """Every path at every batch size; one row each with the median GB/s."""
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with tempfile.TemporaryDirectory(prefix="feeder-bench-", dir=base) as shm_dir:
        return _measure_all(config, Path(shm_dir))


def _measure_all(config: BenchConfig, shm_dir: Path) -> list[dict]:
    # Repeats interleave the paths, so a change of load on a shared machine falls on
    # all of them rather than on whichever ran at that moment.
    rows = []
    for batch_size in config.batch_sizes:
        rates: dict[str, list[float]] = {path: [] for path in _PATHS}
        for _ in range(config.repeats):
            for path in _PATHS:
                rates[path].append(_fresh_process_rate(config, path, batch_size, shm_dir) / 1e9)
        for path, gbps in rates.items():
            rows.append({"path": path, "batch_size": batch_size, "gb_per_s": statistics.median(gbps),
                         "repeats_gb_per_s": gbps, "batch_bytes": batch_size * config.side_px ** 2 * 3})
            print(f"{path:>10} batch {batch_size:>4}: {statistics.median(gbps):6.2f} GB/s  "
                  f"(repeats {', '.join(f'{g:.2f}' for g in gbps)})", flush=True)
    return rows


def targets(rows: list[dict]) -> list[dict]:
    """shm >= 0.5x memcpy; new gRPC payload >= 1.5x today's, per batch size; and,
    with no goal of their own, how far grpcio's ceiling lies above today's path and
    each path behind the call guard and from ``grpc.aio`` against the plain
    thread-per-call server."""
    rate = {(r["path"], r["batch_size"]): r["gb_per_s"] for r in rows}
    checks = []
    for size in sorted({r["batch_size"] for r in rows}):
        servers = [(f"{p}{s}", p, None) for s in (GUARD, AIO) for p in ("shm", "grpc")]
        for path, peer, goal in (("shm", "memcpy", 0.5), ("grpc", TODAY, 1.5), (CEILING, TODAY, None), *servers):
            if goal is None:
                ratio = rate[(path, size)] / rate[(peer, size)]
                checks.append({"name": f"{path} / {peer} at batch {size} (no target)", "ratio": ratio,
                               "target": None, "met": None})
                continue
            ratio = rate[(path, size)] / rate[(peer, size)]
            checks.append({"name": f"{path} / {peer} at batch {size}", "ratio": ratio,
                           "target": goal, "met": ratio >= goal})
    return checks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[64, 256], help="e.g. 64 256")
    parser.add_argument("--side-px", type=int, default=224, help="image side in pixels")
    parser.add_argument("--batches", type=int, default=24, help="batches per timed repeat")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats (median reported)")
    parser.add_argument("--json", type=Path, default=None, help="write results here, e.g. /tmp/transport.json")
    args = parser.parse_args(argv)
    config = BenchConfig(batch_sizes=tuple(args.batch_sizes), side_px=args.side_px,
                         batches=args.batches, repeats=args.repeats)
    rows = run(config)
    checks = targets(rows)
    for check in checks:
        met = "met" if check["met"] else "NOT met"
        verdict = "" if check["target"] is None else f" (target {check['target']}x) {met}"
        print(f"{check['name']}: {check['ratio']:.2f}x{verdict}")
    if args.json is not None:
        write_json(args.json, asdict(config), rows, [sys.executable, *sys.argv], checks)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
