"""transport.heap: malloc's mmap threshold raised once, only for gRPC messages over
glibc's dynamic limit, never over the user's own setting."""

from __future__ import annotations

import logging

import pytest
import torch

from protocol.batch import BatchMeta
from transport import heap
from transport.grpc_payload import GrpcPayloadSender, InlineReceiver, parse_batch


@pytest.fixture
def calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[int, int]]:
    """mallopt calls, recorded instead of made (the setting is process-wide)."""
    made: list[tuple[int, int]] = []

    def mallopt(parameter: int, value: int) -> int:
        made.append((parameter, value))
        return 1

    monkeypatch.setattr(heap, "_decided", False)
    monkeypatch.setattr(heap, "_mallopt", lambda: mallopt)
    for name in heap._USER_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    return made


def test_messages_under_the_dynamic_limit_change_nothing(calls) -> None:
    assert not heap.fit_messages(heap.DYNAMIC_LIMIT_BYTES)
    assert calls == []


def test_the_first_larger_message_raises_the_thresholds_once(calls, caplog) -> None:
    with caplog.at_level(logging.INFO, logger="transport.heap"):
        assert heap.fit_messages(heap.DYNAMIC_LIMIT_BYTES + 1)
        assert not heap.fit_messages(10 * heap.DYNAMIC_LIMIT_BYTES)
    assert calls == [(heap._M_MMAP_THRESHOLD, heap.MMAP_THRESHOLD_BYTES),
                     (heap._M_TRIM_THRESHOLD, heap.TRIM_THRESHOLD_BYTES)]
    assert len([r for r in caplog.records if "malloc's heap" in r.getMessage()]) == 1


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "GLIBC_TUNABLES"])
def test_a_users_own_malloc_setting_is_kept(calls, monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "glibc.malloc.mmap_threshold=1048576" if name == "GLIBC_TUNABLES" else "1048576")
    assert not heap.fit_messages(64 << 20)
    assert calls == []


def test_without_glibc_nothing_happens(calls, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_mallopt", lambda: None)
    assert not heap.fit_messages(64 << 20)


def test_both_halves_of_the_grpc_payload_fit_a_batch_over_the_limit(calls) -> None:
    shape = (1, 2048, 2048 + 1024, 3)  # 18.9 MB: under the limit
    sender = GrpcPayloadSender("s")
    slot = sender.slot_for(shape)
    assert calls == []
    big = (3, *shape[1:])  # 56.6 MB: over it
    slot = sender.slot_for(big)
    assert len(calls) == 2, "the daemon's half"
    slot.array.fill(7)
    data = sender.message(slot, BatchMeta(0, 3, 3, ["a", "b", "c"], torch.arange(3).numpy(),
                                          torch.zeros(3, dtype=torch.bool).numpy()))
    heap._decided = False  # as in another process: the client's
    received = InlineReceiver().receive(parse_batch(data))
    assert len(calls) == 4, "the client's half"
    assert received.images.shape == big and int(received.images[2, -1, -1, -1]) == 7
