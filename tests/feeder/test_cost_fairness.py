"""Streams whose items cost more get no more of --threads: a 448 px stream (each
resize about 4x a 224 px one's) and a 224 px stream read beside it, both as fast as
they come, are given no more worker time for the 448 px one by the daemon's decode
pool (equal on a quiet machine; sharing by items would give it about 1.3x here).

The streams are read in process from the daemon's service, as the servicer reads
them: over gRPC on a small machine the 448 px stream's payload (about 1 GB/s of
pixels) costs more CPU than its decoding, and the check would weigh the transport,
not the pool. Worker time is each stream's ``busy_s`` (its lane's seconds on the
decode threads, measured over the same window for both): a share of the pool, so the
check holds however loaded the machine is."""

from __future__ import annotations

import threading
import time

import pytest

from feeder.stream import BatchStream
from protocol.request import StreamSpec
from shards import jpeg

pytestmark = [pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason())),
              pytest.mark.serial, pytest.mark.slow]

_THREADS = 2
_WARM_S, _WINDOW_S = 2.0, 15.0



def _read(stream: BatchStream, batches: list[int]) -> None:
    for _ in stream:
        batches[0] += 1


def test_a_448_px_stream_gets_the_worker_time_of_a_224_px_stream_beside_it(photo_service):
    sizes = (224, 448)
    specs = [StreamSpec(dataset="s", split="train", batch_size=256, image_size=size, seed=k, epochs=10_000,
                        job_id=f"job-{size}") for k, size in enumerate(sizes)]
    streams = [photo_service.open_stream(spec) for spec in specs]
    # The 224 px stream keeps more runs in flight: its runs are the short ones, and a
    # lane with nothing queued takes nothing (its producer thread late on a busy
    # machine would leave the 448 px stream the pool): so its lane stays busy, and
    # what is left to compare is the pool's sharing.
    streams[0].prefetch = 8
    batches = [[0] for _ in streams]
    readers = [threading.Thread(target=_read, args=(s, b), daemon=True) for s, b in zip(streams, batches)]
    try:
        for reader in readers:
            reader.start()
        time.sleep(_WARM_S)  # past the first batches
        windows = []  # (wall, busy per stream, batches per stream), three in a row
        for _ in range(3):
            before, start = [s.busy_s for s in streams], time.monotonic()
            counted = [b[0] for b in batches]
            time.sleep(_WINDOW_S / 3)
            windows.append((time.monotonic() - start, [s.busy_s - b for s, b in zip(streams, before)],
                            [b[0] - c for b, c in zip(batches, counted)]))
    finally:
        for stream in streams:
            stream.close()
    for wall, busy, made in windows:
        print(f"worker s over {wall:.1f} s: 224 px {busy[0]:.2f}, 448 px {busy[1]:.2f} "
              f"(448/224 {busy[1] / busy[0]:.2f}); batches {made[0]} and {made[1]}; "
              f"threads busy {sum(busy) / wall:.2f} of {_THREADS}")  # with -s
        assert min(made) > 0, made
        assert sum(busy) / wall > 0.5 * _THREADS, busy  # both streams kept the pool busy
    # The median window: one window of a busy machine's other work does not decide.
    # One-sided: the costlier stream gets no more (the 448 px stream's lane, the one
    # that may now run dry, may get less).
    ratios = sorted(busy[1] / busy[0] for _, busy, _ in windows)
    assert ratios[1] <= 1.15, windows
