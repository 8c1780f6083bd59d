from __future__ import annotations

import logging

import pytest
import torch

from core.errors import InvalidArgument
from protocol.request import from_request
from protos import feeder_pb2
from tests.transport.conftest import make_batch
from transport.base import BatchSender, HostIdentity, TransportConfig, TransportKind, TransportUnavailable
from transport.daemon import TransportHub, TransportRequest

SLOT_BYTES = 4 * 8 * 8 * 3


def _hub(config: TransportConfig) -> tuple[TransportHub, HostIdentity]:
    hub = TransportHub(config)
    return hub, hub.host


def test_same_host_client_gets_shared_memory(config):
    hub, host = _hub(config)
    sender = hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES)
    assert sender.kind == TransportKind.SHM and sender.stream_id.startswith(hub.prefix)
    assert hub.reserved_bytes() == 2 * SLOT_BYTES + 2 * 8  # two slots and their release words
    hub.close_all()


@pytest.mark.parametrize("request_", [
    TransportRequest(preference=TransportKind.GRPC),
    TransportRequest(),  # a client that did not say where it runs
])
def test_grpc_when_asked_or_unknown_host(config, request_):
    hub, _ = _hub(config)
    assert hub.open_sender(request_, SLOT_BYTES).kind == TransportKind.GRPC


def test_client_on_another_host_asking_for_shm_falls_back_with_one_warning(config, caplog):
    hub, _ = _hub(config)
    other = HostIdentity(boot_id="another-kernel", hostname="elsewhere", shm_device=1)
    with caplog.at_level(logging.DEBUG, logger="transport.daemon"):
        for _ in range(2):
            sender = hub.open_sender(TransportRequest(TransportKind.SHM, other.client_host()), SLOT_BYTES)
            assert sender.kind == TransportKind.GRPC
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "elsewhere" in warnings[0].getMessage()


def test_full_shm_falls_back_to_grpc(config, shm_dir, monkeypatch, caplog):
    import errno
    import os

    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    hub, host = _hub(config)
    with caplog.at_level(logging.WARNING, logger="transport.daemon"):
        sender = hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES)
    assert sender.kind == TransportKind.GRPC
    assert "shared memory full" in caplog.text
    assert list(shm_dir.iterdir()) == []


def test_budget_bounds_shared_memory(shm_dir):
    config = TransportConfig(shm_dir=shm_dir, ring_slots=2, shm_budget_bytes=3 * SLOT_BYTES)
    hub, host = _hub(config)
    assert hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES).kind == TransportKind.SHM
    assert hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES).kind == TransportKind.GRPC
    hub.close_all()


def test_release_routes_ignores_ended_streams_and_refuses_bad_slots(config, shm_dir):
    hub, host = _hub(config)
    sender = hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES)
    pixels, _ = make_batch()
    a, b = sender.slot_for(pixels.shape), sender.slot_for(pixels.shape)
    ref = lambda slot, sid=sender.stream_id: feeder_pb2.SlotRef(  # noqa: E731
        stream_id=sid, index=slot.index, generation=slot.generation)
    assert hub.release([ref(a), ref(a, "feeder-1-ff-9")]) == 1
    with pytest.raises(InvalidArgument, match="released twice"):
        hub.release([ref(a), ref(b)])  # a twice: b is still released
    assert sender.slot_for(pixels.shape).index in (0, 1)
    assert sender.inline_batches == 0
    hub.close_sender(sender)
    assert hub.release([ref(b)]) == 0  # stream over: ignored
    assert list(shm_dir.iterdir()) == []


def test_close_all_unlinks_every_segment(config, shm_dir):
    hub, host = _hub(config)
    for _ in range(3):
        hub.open_sender(TransportRequest(client=host.client_host()), SLOT_BYTES)
    assert len(list(shm_dir.iterdir())) == 3
    hub.close_all()
    assert list(shm_dir.iterdir()) == [] and hub.reserved_bytes() == 0


def test_the_transport_part_is_read_once_with_the_rest_of_the_request():
    host = HostIdentity.of_this_process().client_host("GPU-1")
    asked = dict(dataset="sample", split="train", world_size=1, batch_size=4, image_size=32)
    request = feeder_pb2.StreamRequest(**asked, transport=feeder_pb2.TRANSPORT_SHM, client_host=host.to_message(),
                                       prefetch_batches=6)
    assert TransportRequest.of(from_request(request)) == TransportRequest(TransportKind.SHM, host, 6)
    assert TransportRequest.of(from_request(feeder_pb2.StreamRequest(**asked))) == TransportRequest()
    assert TransportRequest(TransportKind.SHM, host).gpu_uuid == "GPU-1" and TransportRequest().gpu_uuid == ""
    with pytest.raises(InvalidArgument, match="transport: unknown value 9"):
        from_request(feeder_pb2.StreamRequest(**asked, transport=9))


def test_host_identity_needs_same_kernel_and_same_shm():
    host = HostIdentity("boot", "a", 5)
    assert host.shares_shm_with(HostIdentity("boot", "b", 5))
    assert not host.shares_shm_with(HostIdentity("boot", "a", 6))  # a private /dev/shm
    assert not host.shares_shm_with(HostIdentity("other", "a", 5))
    assert not HostIdentity("", "a", 5).shares_shm_with(HostIdentity("", "a", 5))
    assert host.shares_shm_with(host.client_host("GPU-1"))  # what a client says of itself


GPU = "GPU-5f3a0c1e-aaaa-4bbb-8ccc-0123456789ab"  # a GPU no process here sees


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_shm_asked_for_on_the_clients_gpu_is_host_shared_memory(config, caplog):
    hub, host = _hub(config)
    with caplog.at_level(logging.DEBUG, logger="transport.daemon"):
        asked = TransportRequest(TransportKind.SHM, host.client_host(GPU))
        sender = hub.open_sender(asked, SLOT_BYTES, batch_gpu_uuid=GPU)
    assert sender.kind == TransportKind.SHM
    assert caplog.records == []  # CUDA IPC was not even tried
    hub.close_all()


def test_cuda_ipc_that_cannot_work_falls_to_shm_then_grpc_with_one_warning_each(config, monkeypatch, caplog):
    import errno
    import os

    hub, host = _hub(config)
    request = TransportRequest(TransportKind.CUDA_IPC, host.client_host(GPU))
    with caplog.at_level(logging.DEBUG, logger="transport.daemon"):
        kinds = [hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=GPU).kind for _ in range(2)]
        monkeypatch.setattr(os, "posix_fallocate", lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        kinds += [hub.open_sender(request, SLOT_BYTES, batch_gpu_uuid=GPU).kind for _ in range(2)]
    assert kinds == [TransportKind.SHM, TransportKind.SHM, TransportKind.GRPC, TransportKind.GRPC]
    first, second = _warnings(caplog)
    assert first.startswith("batches go over shared memory: CUDA IPC")  # no CUDA here, or not that GPU
    assert second.startswith("batches go inline over gRPC:") and "full" in second
    hub.close_all()


def test_cuda_ipc_asked_for_batches_made_elsewhere_is_shared_memory(config, caplog):
    hub, host = _hub(config)
    with caplog.at_level(logging.WARNING, logger="transport.daemon"):
        sender = hub.open_sender(TransportRequest(TransportKind.CUDA_IPC, host.client_host(GPU)), SLOT_BYTES)
    assert sender.kind == TransportKind.SHM
    (warning,) = _warnings(caplog)
    assert "not made on the client's GPU" in warning and GPU in warning
    hub.close_all()


@pytest.mark.parametrize("refusal", [
    RuntimeError("CUDA error: invalid device context\nmore"),
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 385 MiB"),
    torch.AcceleratorError("CUDA error: operation not supported"),
])
def test_a_cuda_refusal_is_an_unavailable_transport(refusal):
    from transport.cuda_ipc import refused_as_unavailable

    with pytest.raises(TransportUnavailable, match=r"^CUDA IPC: opening: \w+Error: ") as raised:
        with refused_as_unavailable("opening"):
            raise refusal
    assert raised.value.__cause__ is refusal and "\n" not in str(raised.value)


class _DeviceRing(BatchSender):
    """A sender whose ring a client holds until ``let_go`` is set."""

    kind = TransportKind.CUDA_IPC

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self.closed = False
        self.let_go = False

    def slot_for(self, shape):
        raise NotImplementedError

    def message(self, slot, meta):
        raise NotImplementedError

    def release(self, index, generation):
        pass

    def close(self):
        self.closed = True

    def retire(self):
        return self.closed and self.let_go


def test_an_ended_streams_ring_is_given_back_once_its_client_lets_go(config):
    hub, _ = _hub(config)
    held, free = _DeviceRing("feeder-1-ab-1"), _DeviceRing("feeder-1-ab-2")
    free.let_go = True
    hub.close_sender(held)
    hub.close_sender(free)
    assert held.closed and hub.collect() == 1
    held.let_go = True
    assert hub.collect() == 0
