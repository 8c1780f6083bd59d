"""A loader's stream specs: checked as the daemon reads them, and against what the
daemon said about itself and the split."""

from __future__ import annotations

import pytest

from clients.spec import Sizes, SplitInfo, StreamSpecs, make_spec
from core.errors import ConfigError
from protocol.plan import LastBatch
from protocol.request import MAX_EPOCH


def _specs(num_samples: int = 100, max_batch_size: int = 64, last_batch: LastBatch = LastBatch.DROP,
           batch_size: int = 8, world_size: int = 3) -> StreamSpecs:
    base = make_spec(Sizes(batch_size, 32), dataset="d", split="train", rank=2, world_size=world_size,
                     last_batch=last_batch)
    return StreamSpecs(base, SplitInfo(num_samples, ["a"], max_batch_size))


def test_the_part_length_and_batches_follow_the_plan() -> None:
    drop, pad = _specs(), _specs(last_batch=LastBatch.PAD)
    assert (drop.samples_per_rank, pad.samples_per_rank) == (33, 34)
    assert (drop.batches_after(0, 8), pad.batches_after(0, 8)) == (4, 5)
    assert (drop.batches_after(30, 8), drop.batches_after(40, 8)) == (0, 0)


def test_a_batch_over_the_daemons_limit_is_refused_unless_the_daemon_did_not_say() -> None:
    with pytest.raises(ConfigError, match=r"^batch_size: 30 is not in 1\.\.16$"):
        _specs(max_batch_size=16, batch_size=30)
    assert _specs(max_batch_size=0, batch_size=30).base.batch_size == 30  # a daemon from before the field


def test_a_drop_batch_larger_than_the_part_is_refused_and_a_pad_one_is_not() -> None:
    with pytest.raises(ConfigError, match=r"batch_size: 34 is larger than rank 2's part of d/train \(33 samples: 100"):
        _specs(batch_size=34)
    assert _specs(batch_size=34, last_batch=LastBatch.PAD).batches_after(0, 34) == 1  # one padded batch
    specs = _specs()
    with pytest.raises(ConfigError, match="batch_size: 34 is larger"):
        specs.check(Sizes(34, 32))


def test_each_stream_is_checked_as_the_daemon_reads_it() -> None:
    specs = _specs()
    spec = specs.spec(5, 16, Sizes(16, 48, 0.25), epochs=3)
    assert (spec.epoch, spec.start_cursor, spec.epochs, spec.batch_size, spec.image_size) == (5, 16, 3, 16, 48)
    assert spec.crop.min_scale == pytest.approx(0.25) and spec.rank == 2
    with pytest.raises(ConfigError, match="^epochs: 2 epochs from epoch"):
        specs.spec(MAX_EPOCH, 0, Sizes(8, 32), epochs=2)
    with pytest.raises(ConfigError, match="^epoch: -1"):
        specs.check(Sizes(8, 32), epoch=-1)
