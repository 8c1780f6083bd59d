from __future__ import annotations

import errno
import gc
import os
import signal
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest

from core.errors import DataError, InvalidArgument
from tests.common.env import child_env
from tests.transport.conftest import make_batch
from transport.base import TransportClosed, TransportConfig, TransportUnavailable
from transport.grpc_payload import parse_batch
from transport.shm import ShmReceiver, ShmRing, ShmSender, instance_prefix, sweep_stale


class Sink:
    """A ReleaseSink that records what it is given."""

    def __init__(self) -> None:
        self.refs: list[tuple[str, int, int]] = []

    def __call__(self, ref, after=None) -> None:
        self.refs.append((ref.stream_id, ref.index, ref.generation))


def _sender(config: TransportConfig, slot_bytes: int = 4 * 8 * 8 * 3) -> ShmSender:
    return ShmSender(instance_prefix() + "1", config, slot_bytes)


def _send(sender, pixels, meta) -> bytes:
    slot = sender.slot_for(pixels.shape)
    np.copyto(slot.array, pixels)
    return sender.message(slot, meta)


def _segments(shm_dir: Path) -> list[str]:
    return sorted(p.name for p in shm_dir.iterdir())


def _run(code: str, *args: str) -> subprocess.Popen:
    env = child_env()
    return subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True)


def test_round_trip_through_a_slot(config, shm_dir):
    sender = _sender(config)
    pixels, meta = make_batch()
    data = _send(sender, pixels, meta)
    assert len(data) < 1000  # only a reference travels
    sink = Sink()
    batch = ShmReceiver(sink, shm_dir).receive(parse_batch(data))
    np.testing.assert_array_equal(batch.images.numpy(), pixels)
    assert list(batch.message.keys) == meta.keys
    assert not _released_in_band(sender, 0, 1)
    batch.release()
    batch.release()  # idempotent
    assert _released_in_band(sender, 0, 1) and sink.refs == []  # the word, not a call
    sender.close()


def _released_in_band(sender, index: int, generation: int) -> bool:
    """The slot's release word holds the loan's generation (the client gave it back)."""
    return int(sender.ring._words[index]) == generation


def test_a_slot_released_in_band_is_lent_again(shm_dir):
    sender = _sender(TransportConfig(shm_dir=shm_dir, ring_slots=1, slot_wait_s=2.0))
    pixels, meta = make_batch()
    receiver = ShmReceiver(Sink(), shm_dir)
    for expected in range(1, 4):  # one slot: each batch needs the last one back
        batch = receiver.receive(parse_batch(_send(sender, pixels, meta)))
        assert batch.message.shm.slot.generation == expected
        batch.release()
    assert sender.inline_batches == 0
    sender.close()


def test_segment_is_owner_only_and_unlinked_on_close(config, shm_dir):
    sender = _sender(config)
    (path,) = shm_dir.iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert path.name == sender.stream_id
    sender.close()
    sender.close()
    assert _segments(shm_dir) == []


@pytest.mark.slow
def test_unreferenced_batch_releases_its_slot_kept_views_hold_it(config, shm_dir):
    sender = _sender(config)
    pixels, meta = make_batch()
    sink = Sink()
    batch = ShmReceiver(sink, shm_dir).receive(parse_batch(_send(sender, pixels, meta)))
    kept = batch.images.permute(0, 3, 1, 2)[1]
    del batch
    gc.collect()
    assert not _released_in_band(sender, 0, 1)  # a view still uses the slot
    np.testing.assert_array_equal(kept.numpy(), pixels[1].transpose(2, 0, 1))
    del kept
    gc.collect()
    assert _released_in_band(sender, 0, 1) and sink.refs == []
    sender.close()


def test_stale_and_double_release_are_refused_and_the_ring_keeps_working(shm_dir):
    sender = _sender(TransportConfig(shm_dir=shm_dir, ring_slots=1, slot_wait_s=0.1))
    pixels, _ = make_batch()
    first = sender.slot_for(pixels.shape)
    sender.release(first.index, first.generation)
    with pytest.raises(InvalidArgument, match="released twice"):
        sender.release(first.index, first.generation)
    again = sender.slot_for(pixels.shape)
    assert (again.index, again.generation) == (first.index, first.generation + 1)
    with pytest.raises(InvalidArgument, match="stale generation"):
        sender.release(first.index, first.generation)
    with pytest.raises(InvalidArgument, match="no such slot"):
        sender.release(7, 1)
    sender.release(again.index, again.generation)
    assert sender.slot_for(pixels.shape).index == 0  # free again, not sent inline
    assert sender.inline_batches == 0
    sender.close()


def test_full_ring_waits_then_a_release_lets_the_producer_on(shm_dir):
    config = TransportConfig(shm_dir=shm_dir, ring_slots=1, slot_wait_s=10.0)
    sender = _sender(config)
    pixels, _ = make_batch()
    held = sender.slot_for(pixels.shape)
    released = threading.Event()

    def release() -> None:
        released.set()  # before the slot is free: set whenever slot_for can return
        sender.release(held.index, held.generation)

    threading.Timer(0.2, release).start()
    nxt = sender.slot_for(pixels.shape)
    assert nxt.index == held.index and released.is_set()  # it waited for the release
    sender.close()


def test_ring_that_stays_full_sends_the_batch_inline(config, shm_dir):
    sender = _sender(config)
    pixels, meta = make_batch()
    for _ in range(2):
        sender.slot_for(pixels.shape)  # the consumer keeps both
    data = _send(sender, pixels, meta)
    wire = parse_batch(data)
    assert wire.message.WhichOneof("pixels") is None and sender.inline_batches == 1
    assert bytes(wire.pixels) == pixels.tobytes()
    sender.close()


def test_close_wakes_a_waiting_producer(shm_dir):
    ring = ShmRing(shm_dir / (instance_prefix() + "1"), 1, 16)
    ring.acquire(None)
    threading.Timer(0.2, ring.close).start()
    with pytest.raises(TransportClosed):
        ring.acquire(None)
    assert _segments(shm_dir) == []


def test_full_shm_is_a_clear_exception_and_leaves_nothing(config, shm_dir, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(TransportUnavailable, match="shared memory full or too small"):
        _sender(config)
    assert _segments(shm_dir) == []


def test_segment_larger_than_shm_fails_at_reservation(config, shm_dir):
    # /dev/shm itself is far larger than any test; a size past it must still fail
    # at reservation, not at first touch.
    free = os.statvfs(shm_dir)
    too_big = free.f_bavail * free.f_frsize + (1 << 30)
    with pytest.raises(TransportUnavailable):
        ShmSender(instance_prefix() + "1", config, too_big // config.ring_slots + 1)
    assert _segments(shm_dir) == []


def test_receiver_refuses_a_name_that_is_not_a_segment(shm_dir):
    from protos import feeder_pb2

    message = feeder_pb2.Batch(shape=[1, 1, 1, 3], shm=feeder_pb2.ShmSlot(
        slot=feeder_pb2.SlotRef(index=0), segment="../etc/passwd", segment_bytes=3))
    with pytest.raises(DataError):
        ShmReceiver(Sink(), shm_dir).receive(parse_batch(message.SerializeToString()))


_CLIENT = """
import sys, time
from pathlib import Path
from transport.grpc_payload import parse_batch
from transport.shm import ShmReceiver
data = Path(sys.argv[1]).read_bytes()
batch = ShmReceiver(lambda ref, after=None: None, Path(sys.argv[2])).receive(parse_batch(data))
print(int(batch.images.sum()), flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_client_killed_with_sigkill_leaves_nothing(config, shm_dir, tmp_path):
    sender = _sender(config)
    pixels, meta = make_batch()
    (tmp_path / "msg").write_bytes(_send(sender, pixels, meta))
    client = _run(_CLIENT, str(tmp_path / "msg"), str(shm_dir))
    try:
        assert int(client.stdout.readline()) == int(pixels.sum())  # mapped and read
    finally:
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    assert client.returncode == -signal.SIGKILL  # it died holding the mapping
    # The daemon's ring is untouched by the client's death; its close cleans up.
    again = sender.slot_for(pixels.shape)
    assert again.index == 1
    sender.close()  # what cancellation of the client's stream does
    assert _segments(shm_dir) == []


_DAEMON = """
import sys, time
from pathlib import Path
from transport.base import TransportConfig
from transport.shm import ShmSender, instance_prefix
sender = ShmSender(instance_prefix() + "1", TransportConfig(shm_dir=Path(sys.argv[1])), 4096)
print(sender.stream_id, flush=True)
time.sleep(60)
"""


@pytest.mark.slow
def test_sweep_removes_segments_of_a_daemon_killed_with_sigkill(shm_dir):
    daemon = _run(_DAEMON, str(shm_dir))
    name = daemon.stdout.readline().strip()
    live = _sender(TransportConfig(shm_dir=shm_dir))
    assert sweep_stale(shm_dir) == []  # both owners alive
    daemon.send_signal(signal.SIGKILL)
    daemon.wait(10)
    assert sweep_stale(shm_dir) == [name]
    assert _segments(shm_dir) == [live.stream_id]
    live.close()


def test_sweep_removes_an_unlocked_segment_whatever_its_pid_and_age(shm_dir):
    # Our pid, written a moment ago, but nobody's lock: a daemon restarted under the
    # same pid (pid 1 in a container) left it.
    path = shm_dir / f"feeder-{os.getpid()}-abcd-3"
    path.write_bytes(b"x")
    making = shm_dir / f"feeder-{os.getpid()}-abcd-4.new"  # a daemon killed while making one
    making.write_bytes(b"x")
    assert sorted(sweep_stale(shm_dir)) == [path.name, making.name]
    (shm_dir / "not-ours").write_bytes(b"x")
    assert sweep_stale(shm_dir) == [] and _segments(shm_dir) == ["not-ours"]


@pytest.mark.slow
def test_a_segment_is_locked_before_it_has_its_name(shm_dir, monkeypatch):
    import transport.shm as shm

    seen = []
    real_link = os.link

    def link(source, target):  # what a sweep running at that moment would find
        seen.append((sorted(p.name for p in shm_dir.iterdir()), sweep_stale(shm_dir)))
        real_link(source, target)

    monkeypatch.setattr(shm.os, "link", link)
    sender = _sender(TransportConfig(shm_dir=shm_dir))
    assert seen == [([sender.stream_id + ".new"], [])]  # only the locked one being made: kept
    assert _segments(shm_dir) == [sender.stream_id]
    sender.close()


