"""A client process that opens streams of a daemon and reads them as fast as they
come, until it is killed: what the share tests run as a rank, or as a client trying
to take more than its share.

    python -m tests.common.stream_readers ADDRESS CONNECTIONS JOB [JOB ...]

opens one stream per JOB (an empty one: no job id), spread over CONNECTIONS
connections of its own (one connection per channel, as separate processes have),
prints ``open`` once every stream has its first batch, then keeps reading.
Rank and world size: ``--rank R --world W`` (default 0 of 1).
"""

from __future__ import annotations

import argparse
import threading

import grpc

from protos import feeder_pb2, feeder_pb2_grpc

__all__ = ["reader_command"]

_OWN_CONNECTION = [("grpc.use_local_subchannel_pool", 1), ("grpc.max_receive_message_length", -1)]


def reader_command(address: str, jobs: list[str], connections: int = 1, rank: int = 0,
                   world: int = 1) -> list[str]:
    """The arguments after ``python -m`` of a reader process."""
    return ["tests.common.stream_readers", address, str(connections), *jobs, "--rank", str(rank),
            "--world", str(world)]


def _request(job: str, rank: int, world: int) -> feeder_pb2.StreamRequest:
    return feeder_pb2.StreamRequest(dataset="sample", split="train", job_id=job, rank=rank, world_size=world,
                                    batch_size=64, image_size=64, epochs=100_000,
                                    last_batch=feeder_pb2.LAST_BATCH_PAD, transport=feeder_pb2.TRANSPORT_GRPC)


def _read(call, opened: threading.Barrier) -> None:
    next(call)
    opened.wait()
    for _ in call:
        pass


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("address")
    parser.add_argument("connections", type=int)
    parser.add_argument("jobs", nargs="+")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--world", type=int, default=1)
    args = parser.parse_args()
    channels = [grpc.insecure_channel(args.address, options=_OWN_CONNECTION) for _ in range(args.connections)]
    opened = threading.Barrier(len(args.jobs) + 1)
    for k, job in enumerate(args.jobs):
        call = feeder_pb2_grpc.FeederStub(channels[k % len(channels)]).StreamBatches(
            _request(job, args.rank, args.world))
        threading.Thread(target=_read, args=(call, opened), daemon=True).start()
    opened.wait()
    print("open", flush=True)
    threading.Event().wait()  # until killed


if __name__ == "__main__":
    main()
