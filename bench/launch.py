"""What ``feeder run`` adds to a job's start over a bare ``feeder serve &``: the
seconds from the launch to the command's first line, against ``feeder serve &``
followed by the wait a user would write (ask gRPC health every 0.1 s until SERVING),
then the same command. Same shards and options, the two alternated, median of repeats.

    .venv/bin/python -m bench.launch [--repeats 5] [--out bench/results/launch.json]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.data import prepare_sample
from bench.report import write_json
from bench.throughput import DEFAULT_CACHE

# The job's first line: when it started, on the clock both sides read.
_COMMAND = [sys.executable, "-c", "import time; print(time.time(), flush=True)"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _serve_options(shards: Path, port: int, shm: Path) -> list[str]:
    return ["--dataset", f"sample={shards}", "--device", "cpu", "--threads", "1", "--port", str(port),
            "--shm-dir", str(shm), "--grace-s", "1"]


def _serving(address: str) -> bool:
    with grpc.insecure_channel(address) as channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=1)
        except grpc.RpcError:
            return False
    return bool(reply.status == health_pb2.HealthCheckResponse.SERVING)


def _first_line(proc: subprocess.Popen[str]) -> float:
    line = proc.stdout.readline()  # type: ignore[union-attr]
    if not line:
        raise SystemExit(f"bench: {proc.args!r} ended without its first line")
    return float(line)


def bare(shards: Path, shm: Path) -> float:
    """``feeder serve &``, a health wait loop, the command: seconds to its first line."""
    port = _free_port()
    started = time.time()
    daemon = subprocess.Popen([sys.executable, "-m", "feeder", "serve", *_serve_options(shards, port, shm)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while not _serving(f"127.0.0.1:{port}"):
            if daemon.poll() is not None:
                raise SystemExit(f"bench: feeder serve exited with {daemon.returncode}")
            time.sleep(0.1)
        command = subprocess.Popen(_COMMAND, stdout=subprocess.PIPE, text=True)
        first = _first_line(command)
        command.wait()
        return first - started
    finally:
        daemon.send_signal(signal.SIGTERM)
        daemon.wait(30)


def launched(shards: Path, shm: Path) -> float:
    """``feeder run ... -- command``: seconds to the command's first line."""
    started = time.time()
    run = subprocess.Popen([sys.executable, "-m", "feeder", "run", *_serve_options(shards, _free_port(), shm),
                            "--", *_COMMAND], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    first = _first_line(run)
    if run.wait(60) != 0:
        raise SystemExit(f"bench: feeder run exited with {run.returncode}")
    return first - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where the sample data is kept")
    parser.add_argument("--out", type=Path, default=Path("bench/results/launch.json"))
    args = parser.parse_args()
    shards = prepare_sample(args.cache).shards
    times: dict[str, list[float]] = {"feeder serve &": [], "feeder run": []}
    with tempfile.TemporaryDirectory(prefix="feeder-launch-") as shm:
        for repeat in range(args.repeats):
            for name, start in (("feeder serve &", bare), ("feeder run", launched)):
                times[name].append(start(shards, Path(shm)))
                print(f"{repeat}: {name}: {times[name][-1]:.2f} s", flush=True)
        left = os.listdir(shm)
    medians = {name: statistics.median(found) for name, found in times.items()}
    rows = [{"start": name, "median_s": medians[name], "runs_s": found} for name, found in times.items()]
    added = medians["feeder run"] - medians["feeder serve &"]
    target = {"name": "feeder run adds <= 3 s to a job's start", "value_s": added, "met": added <= 3.0}
    write_json(args.out, {"repeats": args.repeats, "shards": str(shards), "segments_left": left}, rows,
               sys.argv, [target])
    print(f"feeder run adds {added:+.2f} s to the start (median of {args.repeats}: "
          f"{medians['feeder run']:.2f} s against {medians['feeder serve &']:.2f} s); wrote {args.out}")


if __name__ == "__main__":
    main()
