"""FeederLoader against a real in-process daemon on real sample shards."""

from __future__ import annotations

import threading
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from clients import IMAGENET_MEAN, IMAGENET_STD, FeederLoader
from core.errors import NotFound, ServiceUnavailable
from shards.layout import index_path
from tests.common.sample_daemon import N_TRAIN, N_VAL, start_daemon


@pytest.fixture(scope="module")
def labels(shards: Path) -> dict[str, dict[str, int]]:
    """split -> key -> label, straight from the index files."""
    out = {}
    for split in ("train", "val"):
        table = pq.read_table(index_path(shards, split), columns=["key", "label"]).to_pydict()
        out[split] = dict(zip(table["key"], table["label"]))
    return out


def _loader(address: str, **options) -> FeederLoader:
    base = dict(dataset="sample", batch_size=8, image_size=32, rank=0, world_size=1,
                return_keys=True)
    return FeederLoader(address=address, **(base | options))


def _drain(loader: FeederLoader) -> list[tuple[torch.Tensor, torch.Tensor, list[str]]]:
    return [batch for batch in loader]


def test_two_ranks_get_every_sample_once_with_its_own_label(daemon, labels) -> None:
    seen: Counter[str] = Counter()
    for rank in range(2):
        with _loader(daemon, rank=rank, world_size=2) as loader:
            batches = _drain(loader)
            assert len(batches) == N_TRAIN // 2 // 8
            for images, batch_labels, keys in batches:
                assert images.shape == (8, 3, 32, 32) and images.dtype == torch.float32
                assert batch_labels.tolist() == [labels["train"][k] for k in keys]
                seen.update(keys)
    assert seen == Counter(labels["train"].keys())


def test_pad_policy_covers_val_once_and_marks_repeats(daemon, labels) -> None:
    seen: Counter[str] = Counter()
    per_rank = -(-N_VAL // 3)  # the last rank's part ends with a repeat
    for rank in range(3):
        with _loader(daemon, split="val", batch_size=4, rank=rank, world_size=3,
                     last_batch="pad", return_padding=True) as loader:
            expected = len(loader)
            batches = _drain(loader)
            assert len(batches) == expected == -(-per_rank // 4)
            for _, _, keys, padding in batches:
                seen.update(k for k, pad in zip(keys, padding.tolist()) if not pad)
    assert seen == Counter(labels["val"].keys())


def test_len_counts_an_epochs_batches_equal_on_every_rank(daemon) -> None:
    lengths = []
    for rank in range(3):
        with _loader(daemon, batch_size=5, rank=rank, world_size=3) as loader:
            lengths.append((len(loader), len(_drain(loader))))
    per_rank = N_TRAIN // 3
    assert lengths == [(per_rank // 5, per_rank // 5)] * 3


def test_state_dict_resumes_on_next_sample_with_new_sizes(daemon, labels) -> None:
    first = _loader(daemon)
    head = []
    for _, _, keys in first:
        head += keys
        if len(head) == 24:
            break
    state = first.state_dict()
    first.close()
    assert state["cursor"] == 24 and state["epoch"] == 0
    second = _loader(daemon, batch_size=5, image_size=40)
    second.load_state_dict(state)
    assert len(second) == 24 // 8 + (N_TRAIN - 24) // 5  # the 3 batches before the checkpoint, and the rest
    tail, batches = [], 0
    for images, _, keys in second:
        assert images.shape[-1] == 40
        tail += keys
        batches += 1
    assert batches == (N_TRAIN - 24) // 5 and second.epoch == 1 and len(second) == N_TRAIN // 5
    second.close()
    assert Counter(head + tail) == Counter({k: 1 for k in head + tail})
    assert len(head + tail) == 24 + 5 * ((N_TRAIN - 24) // 5)


def test_size_changes_take_effect_at_next_batch(daemon) -> None:
    with _loader(daemon, prefetch_batches=4) as loader:
        shapes, keys = [], []
        for images, _, batch_keys in loader:
            shapes.append(tuple(images.shape))
            keys += batch_keys
            if len(shapes) == 2:
                loader.set_batch_size(4)
                loader.set_image_size(24)
        assert shapes[:3] == [(8, 3, 32, 32), (8, 3, 32, 32), (4, 3, 24, 24)]
        assert len(keys) == len(set(keys)) == N_TRAIN
        assert loader.epoch == 1 and loader.cursor == 0


def test_epochs_advance_and_reshuffle(daemon) -> None:
    with _loader(daemon) as loader:
        orders = []
        for epoch in range(2):
            loader.set_epoch(epoch)
            orders.append([k for _, _, keys in loader for k in keys])
        assert sorted(orders[0]) == sorted(orders[1]) and orders[0] != orders[1]


def test_images_normalised_on_device_from_uint8(daemon) -> None:
    options = dict(split="val", augment="val", batch_size=8, image_size=32)
    with _loader(daemon, normalize=False, **options) as raw_loader:
        raw, _, raw_keys = next(iter(raw_loader))
    with _loader(daemon, **options) as loader:
        images, _, keys = next(iter(loader))
    assert keys == raw_keys
    assert raw.dtype == torch.uint8 and raw.shape == (8, 3, 32, 32)
    assert images.is_contiguous()  # as a model built without a memory format wants them
    with _loader(daemon, channels_last=True, **options) as nhwc_loader:
        nhwc, _, nhwc_keys = next(iter(nhwc_loader))
    assert nhwc_keys == keys and nhwc.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(nhwc, images)
    mean = torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(IMAGENET_STD).view(1, 3, 1, 1)
    torch.testing.assert_close(images, (raw.float() / 255 - mean) / std)


def test_wait_seconds_and_stall_fraction_are_recorded(daemon) -> None:
    with _loader(daemon) as loader:
        _drain(loader)
        assert loader.wait_seconds > 0
        assert 0 < loader.stall_fraction <= 1
        assert 0 < loader.longest_wait_s < loader.wait_seconds  # one batch's, not the first's


@pytest.mark.slow
def test_reconnects_after_daemon_restart_without_loss_or_repeat(shards) -> None:
    server, port = start_daemon(shards)
    loader = _loader(f"127.0.0.1:{port}", batch_size=2, image_size=96, prefetch_batches=1,
                     reconnect_timeout_s=60)
    keys: list[str] = []
    replacement = []
    for _, _, batch_keys in loader:
        keys += batch_keys
        if len(keys) == 4:
            server.stop(0).wait(10)
            restart = threading.Timer(1.0, lambda: replacement.append(start_daemon(shards, port)))
            restart.start()
    restart.join()
    replacement[0][0].stop(0).wait(10)
    loader.close()
    assert loader.reconnects >= 1
    assert Counter(keys) == Counter({k: 1 for k in keys}) and len(keys) == N_TRAIN


@pytest.mark.slow
def test_gives_up_after_deadline_naming_the_address(shards) -> None:
    server, port = start_daemon(shards)
    address = f"127.0.0.1:{port}"
    loader = _loader(address, batch_size=2, image_size=96, prefetch_batches=1,
                     reconnect_timeout_s=1.0)
    with pytest.raises(ServiceUnavailable, match=address):
        for count, _ in enumerate(loader):
            if count == 1:
                server.stop(0).wait(10)
    loader.close()


def test_unreachable_daemon_is_a_clear_error() -> None:
    with pytest.raises(ServiceUnavailable, match="127.0.0.1:9"):
        _loader("127.0.0.1:9", connect_timeout_s=0.5)


def test_unknown_dataset_is_not_found(daemon) -> None:
    with pytest.raises(NotFound, match="nope"):
        _loader(daemon, dataset="nope")


@pytest.mark.gpu
def test_cuda_batches_match_cpu_batches(daemon) -> None:
    options = dict(split="val", augment="val", batch_size=8, image_size=32)
    with _loader(daemon, **options) as cpu_loader:
        expected, expected_labels, _ = next(iter(cpu_loader))
    with _loader(daemon, device="cuda", channels_last=True, **options) as loader:
        images, batch_labels, _ = next(iter(loader))
    assert images.is_cuda and batch_labels.is_cuda
    assert images.is_contiguous(memory_format=torch.channels_last)
    torch.testing.assert_close(images.cpu(), expected)
    assert batch_labels.cpu().tolist() == expected_labels.tolist()


def test_one_stream_runs_across_epochs_without_a_gap(shards, labels) -> None:
    server, port = start_daemon(shards)
    try:
        with _loader(f"127.0.0.1:{port}") as loader:
            for epoch in range(3):
                loader.set_epoch(epoch)
                keys = [k for _, _, batch_keys in _drain(loader) for k in batch_keys]
                assert Counter(keys) == Counter(labels["train"].keys())
        # One stream carried the three epochs: the daemon never waited for a new one.
        assert server.metrics.stats().streams_opened == 1
    finally:
        server.stop(0).wait(10)


def test_a_planned_size_change_opens_its_stream_before_the_old_one_drains(shards, labels) -> None:
    server, port = start_daemon(shards)
    try:
        with _loader(f"127.0.0.1:{port}", prefetch_batches=2) as loader:
            loader.plan_sizes(2, batch_size=16, image_size=48)
            opened_ahead = []
            for epoch in range(4):
                loader.set_epoch(epoch)
                size, batch = (32, 8) if epoch < 2 else (48, 16)
                loader.set_batch_size(batch)
                loader.set_image_size(size)
                keys = []
                for images, _, batch_keys in loader:
                    assert images.shape == (batch, 3, size, size)
                    keys += batch_keys
                    if epoch == 1:  # the next phase's stream exists while this one drains
                        opened_ahead.append(loader._streams.successor is not None)
                assert Counter(keys) == Counter(labels["train"].keys())
        # Epochs 0-1 on one stream, 2-3 on another opened during epoch 1: no reopen.
        assert server.metrics.stats().streams_opened == 2
        assert opened_ahead[-1] and not opened_ahead[0]
    finally:
        server.stop(0).wait(10)


def test_epochs_cut_short_open_the_next_epochs_stream_ahead(daemon) -> None:
    # An epoch ended after max_batches_per_epoch: its stream asked for only those, so
    # the next epoch's stream is opened while the cut one drains, not once it is asked.
    with _loader(daemon, max_batches_per_epoch=3) as loader:
        for epoch in range(3):
            loader.set_epoch(epoch)
            assert len(loader) == 3
            taken = _drain(loader)
            assert len(taken) == 3 and loader.position.epoch == epoch + 1
            streams = loader._streams
            ahead = streams.successor or streams.current
            assert ahead is not None and ahead.fetcher.spec.epoch == epoch + 1  # opened already
