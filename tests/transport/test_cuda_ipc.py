"""CUDA IPC across two real processes (needs a CUDA device), and a ring's life after
its stream: given back at once if it never left the daemon, once its client lets go
(or dies) otherwise."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.common.env import ROOT, child_env
from tests.common.waiting import wait_for
from tests.transport.conftest import make_batch
from transport.base import TransportConfig, TransportKind
from transport.shm import instance_prefix

_CLIENT = """
import sys, time
from pathlib import Path
import torch
from transport.cuda_ipc import CudaIpcReceiver
from transport.grpc_payload import parse_batch
released = []
receiver = CudaIpcReceiver(lambda ref, after=None: released.append((ref.index, ref.generation)), Path(sys.argv[2]))
batch = receiver.receive(parse_batch(Path(sys.argv[1]).read_bytes()))
assert batch.images.device.type == "cuda"
torch.cuda.current_stream().wait_event(batch.ready)  # the daemon's write, on the GPU
total = int(batch.images.sum())
batch.release()  # records the slot's free event after the read: no host wait
print(total, batch.images.device.index, released, flush=True)
if len(sys.argv) > 3 and sys.argv[3] == "let-go":  # drops the ring, then lives on
    import gc
    del batch
    receiver.close()
    gc.collect()
    print("let go", flush=True)
if len(sys.argv) > 3:
    time.sleep(600)  # until killed
"""
SLOT_BYTES = 4 * 8 * 8 * 3


def _client(message: Path, shm_dir: Path, *more: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _CLIENT, str(message), str(shm_dir), *more], cwd=ROOT,
                            env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _sent(sender, tmp_path: Path, name: str = "msg"):
    """Writes a batch into a slot of ``sender`` (on the slot's stream, as a producer
    does) and its message into a file."""
    import torch

    pixels, meta = make_batch()
    slot = sender.slot_for(pixels.shape)
    with torch.cuda.stream(slot.stream):
        slot.tensor.copy_(torch.from_numpy(pixels).to(slot.tensor.device))
    (tmp_path / f"{name}.part").write_bytes(sender.message(slot, meta))
    (tmp_path / f"{name}.part").rename(tmp_path / name)
    return pixels, slot


@pytest.mark.gpu
def test_batch_arrives_on_the_clients_device_without_a_host_copy(tmp_path, shm_dir):
    import torch

    from core.gpus import device_uuid
    from transport.cuda_ipc import CudaIpcSender

    sender = CudaIpcSender(f"{instance_prefix()}1", TransportConfig(shm_dir=shm_dir, ring_slots=2), SLOT_BYTES,
                           device_uuid(0))
    pixels, slot = _sent(sender, tmp_path)
    assert slot.tensor.device == torch.device("cuda", 0)
    client = _client(tmp_path / "msg", shm_dir)
    out, err = client.communicate(timeout=120)
    assert client.returncode == 0, err
    total, device, released = out.split(maxsplit=2)
    assert int(total) == int(np.asarray(pixels, dtype=np.int64).sum()) and device == "0"
    assert released.strip() == f"[({slot.index}, {slot.generation})]"
    sender.release(slot.index, slot.generation)
    sender.close()
    assert wait_for(timeout_s=10, predicate=sender.retire)  # the client has exited


def _hub(shm_dir: Path):
    import torch

    from core.gpus import device_uuid
    from transport.base import HostIdentity
    from transport.daemon import TransportHub, TransportRequest

    hub = TransportHub(TransportConfig(shm_dir=shm_dir, ring_slots=10))
    client = HostIdentity.of_this_process(shm_dir).client_host(device_uuid(0))
    request = TransportRequest(TransportKind.CUDA_IPC, client)
    torch.cuda.synchronize()
    torch.cuda.ipc_collect()
    return hub, request, torch.cuda.memory_allocated(0)


def _allocated() -> int:
    import torch

    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(0)


@pytest.mark.gpu
def test_a_ring_that_never_left_the_daemon_is_freed_with_its_stream(shm_dir):
    hub, request, before = _hub(shm_dir)
    sender = hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=request.gpu_uuid)
    assert sender.kind == TransportKind.CUDA_IPC and _allocated() >= before + 10 * SLOT_BYTES
    hub.close_sender(sender)
    assert _allocated() == before and hub.collect() == 0
    assert list(shm_dir.iterdir()) == []  # its holder file is gone too


@pytest.mark.gpu
def test_a_ring_sent_but_never_opened_is_freed_soon_after_its_stream(shm_dir, tmp_path):
    hub, request, before = _hub(shm_dir)
    sender = hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=request.gpu_uuid)
    _sent(sender, tmp_path)  # a message the client never read (its call was cancelled)
    hub.close_sender(sender)
    assert wait_for(timeout_s=10, predicate=lambda: hub.collect() == 0 and _allocated() == before)


@pytest.mark.gpu
def test_a_killed_clients_ring_is_freed_and_a_live_ones_is_not(shm_dir, tmp_path):
    hub, request, before = _hub(shm_dir)
    sender = hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=request.gpu_uuid)
    _sent(sender, tmp_path)
    client = _client(tmp_path / "msg", shm_dir, "hold")
    try:
        assert client.stdout is not None and client.stdout.readline()  # it has opened the ring
        hub.close_sender(sender)
        time.sleep(1.5)  # past the grace for a client about to open it: this one holds it
        assert hub.collect() == 1 and _allocated() > before
        client.send_signal(signal.SIGKILL)
        client.wait(10)
    finally:
        if client.poll() is None:
            client.kill()
    assert wait_for(timeout_s=10, predicate=lambda: hub.collect() == 0 and _allocated() == before)


@pytest.mark.gpu
def test_a_live_client_that_let_go_of_the_ring_frees_it(shm_dir, tmp_path):
    hub, request, before = _hub(shm_dir)
    sender = hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=request.gpu_uuid)
    _sent(sender, tmp_path)
    client = _client(tmp_path / "msg", shm_dir, "let-go")
    try:
        assert client.stdout is not None and client.stdout.readline()  # it has opened the ring
        assert client.stdout.readline().strip() == "let go"  # and dropped it (its storage's finalizer)
        hub.close_sender(sender)
        assert wait_for(timeout_s=10, predicate=lambda: hub.collect() == 0 and _allocated() == before)
        assert client.poll() is None  # alive all along
    finally:
        client.kill()
        client.wait(10)


_CLIENT_OF_MANY = """
import gc, sys, time
from pathlib import Path
import torch
from transport.cuda_ipc import CudaIpcReceiver
from transport.grpc_payload import parse_batch
folder, shm_dir, count = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
for i in range(count):
    message = folder / f"msg-{i}"
    while not message.exists():
        time.sleep(0.005)
    receiver = CudaIpcReceiver(lambda ref, after=None: None, shm_dir)
    batch = receiver.receive(parse_batch(message.read_bytes()))
    torch.cuda.current_stream().wait_event(batch.ready)
    total = int(batch.images.sum())
    batch.release()
    del batch
    receiver.close()  # the stream's ring let go of, as a stream closed normally
    gc.collect()
    print(i, total, flush=True)
time.sleep(600)
"""


def _device_used_bytes() -> int:
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return total - free


@pytest.mark.gpu
def test_fifty_streams_closed_normally_keep_gpu_memory_flat(shm_dir, tmp_path, monkeypatch):
    # Each stream's ring (10 slots) is opened by a live client that reads a batch and
    # lets go, as every stream closed normally does; each must be freed, in the daemon
    # (its allocator) and on the device (the client's mapping).
    import torch

    # The client has let go of each ring before its stream closes: the grace for a
    # client about to open one (1 s a ring, 50 s in all) would only make the test
    # outlast its 45 s limit.
    monkeypatch.setattr("transport.cuda_ipc._OPEN_GRACE_S", 0.0)
    hub, request, before = _hub(shm_dir)
    client = subprocess.Popen([sys.executable, "-c", _CLIENT_OF_MANY, str(tmp_path), str(shm_dir), "50"], cwd=ROOT,
                              env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    used_after_first = 0
    try:
        for i in range(50):
            sender = hub.open_sender(request, 8 << 20, batch_gpu_uuid=request.gpu_uuid)  # 80 MiB a ring
            pixels, slot = _sent(sender, tmp_path, f"msg-{i}")
            assert client.stdout is not None
            line = client.stdout.readline().split()
            assert line == [str(i), str(int(np.asarray(pixels, dtype=np.int64).sum()))], client.stderr
            sender.release(slot.index, slot.generation)
            del slot  # a view of the ring: while it lives, so does the ring's memory
            hub.close_sender(sender)
            assert wait_for(timeout_s=10, predicate=lambda: hub.collect() == 0 and _allocated() == before), i
            torch.cuda.synchronize()
            if i == 0:
                used_after_first = _device_used_bytes()
        assert _device_used_bytes() - used_after_first <= 64 << 20
        assert client.poll() is None  # alive all along
    finally:
        client.kill()
        client.wait(10)


@pytest.mark.gpu
def test_unknown_device_uuid_is_unavailable():
    from transport.base import TransportUnavailable
    from transport.cuda_ipc import device_index

    with pytest.raises(TransportUnavailable):
        device_index("GPU-00000000-0000-0000-0000-000000000000")


class _Recorded:
    """Stands in for torch in the daemon half: the ring, its stream and its events,
    each call in ``calls`` in the order made."""

    def __init__(self) -> None:
        import torch

        self.calls: list[str] = []
        self.device, self.uint8 = torch.device, torch.uint8
        self.cuda = SimpleNamespace(device=lambda device: nullcontext(), Stream=self._stream, Event=self._event)

    def empty(self, *shape: int, **options: object) -> SimpleNamespace:
        return SimpleNamespace(record_stream=lambda stream: self.calls.append(f"record_stream({stream})"),
                               untyped_storage=lambda: SimpleNamespace(_share_cuda_=self._share))

    def _stream(self, device: object, priority: int = 0) -> str:
        return "ring stream"

    def _event(self, interprocess: bool = False) -> SimpleNamespace:
        return SimpleNamespace(ipc_handle=lambda: bytes(64))

    def _share(self) -> tuple[object, ...]:
        self.calls.append("_share_cuda_")
        return (0, b"handle", 2 * SLOT_BYTES, 0, b"/torch_feeder_test_no_such_counter", 0, bytes(64), True)


def test_the_ring_is_tied_to_its_stream_before_it_is_shared(shm_dir, monkeypatch):
    # Written on its own stream, allocated on the current one: freed while writes are
    # queued, its block must not go to another allocation before they have run. torch's
    # record_stream says so only before _share_cuda_, which swaps the storage's deleter
    # for its IPC one (the allocator skips memory with any other deleter).
    from transport import cuda_ipc

    torch = _Recorded()
    monkeypatch.setattr(cuda_ipc, "torch", torch)
    monkeypatch.setattr(cuda_ipc, "device_index", lambda uuid: 0)
    sender = cuda_ipc.CudaIpcSender(f"{instance_prefix()}1", TransportConfig(shm_dir=shm_dir, ring_slots=2),
                                    SLOT_BYTES, "GPU-00000000-0000-0000-0000-000000000000")
    assert torch.calls == ["record_stream(ring stream)", "_share_cuda_"]
    sender.close()
    assert sender.retire() and list(shm_dir.iterdir()) == []


@pytest.mark.slow
def test_the_client_process_keeps_the_packages_this_one_was_given(tmp_path, monkeypatch):
    # The GPU machine brings its packages in a folder of its own on PYTHONPATH: the
    # client process must import those (and this repository), not the machine's own.
    carried = tmp_path / "site"
    carried.mkdir()
    (carried / "carried_probe.py").write_text("WHERE = 'carried'\n")
    monkeypatch.setenv("PYTHONPATH", str(carried))
    code = "import carried_probe, transport.cuda_ipc; print(carried_probe.WHERE, transport.cuda_ipc.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=child_env(), capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["carried", str(ROOT / "transport" / "cuda_ipc.py")]
