"""A rank fed by a pool of daemons: every sample of the epoch exactly once, in the
plan's order, while daemons die, stall, come and go, and one serves another dataset."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest

from clients import FeederLoader
from core.errors import ServiceUnavailable
from launcher.daemon_process import DaemonProcess
from tests.common.shards import build_sample_shards
from tests.common.waiting import wait_for

pytestmark = pytest.mark.slow

_KW = dict(split="train", batch_size=4, image_size=16, return_keys=True, normalize=False, seed=1, rank=0,
           world_size=1, prefetch_next_epoch=False, pool_stall_timeout_s=1.5)


def _daemons(stack: ExitStack, shards: Path, count: int, *options: str) -> list[DaemonProcess]:
    return [stack.enter_context(DaemonProcess({"sample": shards}, ("--threads", "1", *options)))
            for _ in range(count)]


def _keys(loader: FeederLoader, after_batch: dict[int, object] | None = None) -> list[str]:
    """Keys of one epoch, in order; ``after_batch[n]()`` runs after the n-th batch."""
    keys: list[str] = []
    for n, (_, _, batch_keys) in enumerate(loader):
        keys += batch_keys
        if after_batch and n in after_batch:
            after_batch[n]()  # type: ignore[operator]
    return keys


@pytest.fixture(scope="module")
def reference(shards: Path) -> Iterator[list[str]]:
    with ExitStack() as stack:
        (alone,) = _daemons(stack, shards, 1)
        with FeederLoader("sample", address=alone.address, **_KW) as loader:
            yield _keys(loader)


def test_a_daemon_killed_mid_epoch_loses_and_repeats_nothing(shards, reference, caplog):
    caplog.set_level(logging.WARNING, logger="clients.pool")
    with ExitStack() as stack:
        # Little buffered on either side, so the killed daemon still owes batches.
        daemons = _daemons(stack, shards, 3, "--ring-slots", "2", "--queue-batches", "1")
        with FeederLoader("sample", address=[d.address for d in daemons], **(_KW | dict(prefetch_batches=1))) as loader:
            keys = _keys(loader, {1: lambda: os.kill(daemons[1].pid, signal.SIGKILL)})
            # The fault happened: the daemon is dead, and the pool left it mid-epoch.
            assert wait_for(timeout_s=10, predicate=lambda: daemons[1].returncode == -signal.SIGKILL)
            failed = [r.getMessage() for r in caplog.records if "of the pool failed" in r.getMessage()]
            assert failed and all(daemons[1].address in line for line in failed), failed
            assert keys == reference


def test_a_stopped_daemon_is_left_to_the_others_and_used_again_once_it_answers(shards, reference, caplog):
    caplog.set_level(logging.WARNING, logger="clients.pool")
    with ExitStack() as stack:
        # Little buffered on either side, so the stopped daemon still owes batches.
        daemons = _daemons(stack, shards, 3, "--ring-slots", "2", "--queue-batches", "1")
        stopped = daemons[2]
        # Batches of 16 at 224 px: the first batch of a stream taken over takes longer than a poll.
        with FeederLoader("sample", address=[d.address for d in daemons],
                          **(_KW | dict(image_size=224, batch_size=16, prefetch_batches=1))) as loader:
            assert _keys(loader, {1: lambda: os.kill(stopped.pid, signal.SIGSTOP)}) == reference
            # Only the stopped daemon failed: the stall is timed per daemon, from what it
            # was asked. Before: from the start of the consumer's wait, so every daemon
            # that took over after it was "stalled" at its first poll.
            failed = [r.getMessage() for r in caplog.records if "of the pool failed" in r.getMessage()]
            assert failed and all(stopped.address in line for line in failed), failed
            os.kill(stopped.pid, signal.SIGCONT)
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline and not all(m.usable for m in loader._streams.pool.members):
                time.sleep(0.2)
            assert all(m.usable for m in loader._streams.pool.members), "probed and used again"
            assert len(_keys(loader)) == len(reference)  # the next epoch, from all three


def test_a_daemon_added_mid_epoch_is_used_from_the_next_batch(shards, reference):
    with ExitStack() as stack:
        first, second = _daemons(stack, shards, 2)
        with FeederLoader("sample", address=[first.address, second.address], **_KW) as loader:
            third = stack.enter_context(DaemonProcess({"sample": shards}, ("--threads", "1")))
            seen: list[int] = []

            def add() -> None:  # and wait until it answered (a loaded machine takes its time)
                loader.add_daemon(third.address)
                assert wait_for(lambda: all(m.usable for m in loader._streams.pool.members), timeout_s=30)

            keys = _keys(loader, {3: add, **{n: (lambda: seen.append(loader.daemons_in_use)) for n in range(4, 14)}})
            assert keys == reference and 3 in seen


def test_a_daemon_of_another_manifest_is_left_out_naming_both(shards, reference, tmp_path, caplog):
    other = build_sample_shards(tmp_path, classes=4, train_per_class=16, val_per_class=4, seed=7)
    caplog.set_level(logging.ERROR, logger="clients.pool")
    with ExitStack() as stack:
        same = _daemons(stack, shards, 2)
        (different,) = _daemons(stack, other, 1)
        with FeederLoader("sample", address=[*(d.address for d in same), different.address], **_KW) as loader:
            assert _keys(loader) == reference
    lines = [r.getMessage() for r in caplog.records if different.address in r.getMessage()]
    assert len(lines) == 1 and "manifest" in lines[0]


def test_a_pool_whose_daemons_are_all_gone_says_so_naming_them(shards, tmp_path):
    with ExitStack() as stack:
        daemons = _daemons(stack, shards, 2)
        loader = stack.enter_context(FeederLoader("sample", address=[d.address for d in daemons],
                                                  **(_KW | dict(reconnect_timeout_s=3.0))))
        batches = iter(loader)
        next(batches)
        for daemon in daemons:
            os.kill(daemon.pid, signal.SIGKILL)
        with pytest.raises(ServiceUnavailable) as caught:
            for _ in batches:
                pass
        message = str(caught.value)
        assert all(d.address in message for d in daemons) and "rank 0 of 1" in message and "cursor" in message
