"""What each open stream uses, in the ``feeder_stream_*`` gauges: the decode threads
it kept busy, how full its ready queue is, how long its batches waited for its
consumer and how long its consumer was starved; a closed stream's gauges go."""

from __future__ import annotations

import time

import pytest

from protos import feeder_pb2_grpc
from tests.common.waiting import wait_for
from tests.feeder.conftest import connect, request

pytestmark = pytest.mark.slow


def _gauges(server, name: str) -> dict[str, float]:
    """Stream label -> value of ``feeder_stream_<name>``."""
    return {s.labels["stream"]: s.value for metric in server.metrics.registry.collect()
            if metric.name == f"feeder_stream_{name}" for s in metric.samples}


def test_an_unread_stream_shows_a_full_queue_and_a_read_one_its_threads_and_waits(private_server):
    server, port = private_server(queue_batches=2)
    with connect(port) as channel:
        stub = feeder_pb2_grpc.FeederStub(channel)
        unread = stub.StreamBatches(request(batch_size=4, image_size=32, epochs=1000))
        next(unread)  # open, then left alone: its queue fills
        assert wait_for(lambda: len(_gauges(server, "queue_fill")) == 1)
        (slow,) = _gauges(server, "queue_fill")
        assert wait_for(lambda: _gauges(server, "queue_fill").get(slow) == 1.0), _gauges(server, "queue_fill")
        read = stub.StreamBatches(request(batch_size=16, image_size=64, epochs=1000))
        try:
            for _ in read:  # taken as fast as it comes: its consumer waits on the daemon
                busy = {k: v for k, v in _gauges(server, "threads").items() if k != slow}
                waited = {k: v for k, v in _gauges(server, "starved_seconds").items() if k != slow}
                if busy and min(busy.values()) > 0 and waited and min(waited.values()) > 0:
                    break
        finally:
            read.cancel()
        (fast,) = busy
        assert 0 < busy[fast] <= 1.0 + 0.05  # --threads 1: at most the whole budget
        assert wait_for(lambda: _gauges(server, "threads")[slow] == 0.0)  # a full queue asks for no decodes
        held = _gauges(server, "consumer_wait_seconds")[slow]
        assert wait_for(lambda: _gauges(server, "consumer_wait_seconds")[slow] > held)  # its batches wait for it
        unread.cancel()
    assert wait_for(lambda: not _gauges(server, "queue_fill")), "a closed stream's gauges stayed"


@pytest.mark.serial  # compares two durations the machine's load lengthens: alone, after the rest
def test_a_slow_consumer_over_shared_memory_waits_for_itself_not_for_the_daemon(private_server, tmp_path):
    from clients import FeederLoader

    server, port = private_server(shm_dir=tmp_path)
    waited: list[dict[str, float]] = []  # at step 3 and step 10
    with FeederLoader("sample", address=f"127.0.0.1:{port}", batch_size=4, image_size=16, rank=0, world_size=1,
                      transport="shm", shm_dir=tmp_path) as loader:
        for step, _ in enumerate(loader):
            time.sleep(0.2)  # the training step: far slower than the daemon makes 4 images of 16 px
            if step in (3, 10):
                assert loader.transport == "shm"  # the ring's slots held by this client meanwhile
                assert wait_for(lambda: bool(_gauges(server, "consumer_wait_seconds")))
                (stream,) = _gauges(server, "consumer_wait_seconds")
                waited.append({"consumer": _gauges(server, "consumer_wait_seconds")[stream],
                               "starved": _gauges(server, "starved_seconds")[stream]})
            if step == 10:
                break
    # From step 3 on: the first batch, which the consumer did wait for (the stream's
    # pipeline built in it), is left out.
    consumer, starved = (waited[1][key] - waited[0][key] for key in ("consumer", "starved"))
    assert consumer > 0, waited  # the daemon held by the client's slots and its full queue
    assert starved < consumer, waited  # not counted as the daemon being behind
