"""A stream's producer (:class:`feeder.producer.Producer`) on real shards and a real
pipeline, without gRPC or a stream thread: one ready batch per plan slice, in order,
with the slice's samples (keys, labels, padding, cursor) and their pixels at their
positions; only as far ahead of its consumer as the pipeline's prefetch; and the
error policy applied to a sample that does not decode or whose bytes changed."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import pytest

from core.bad_input import OnError
from core.errors import SampleCorrupt
from decode.augment import sample_crops
from decode.jobs import Job
from decode.pipeline import PipelineSpec
from decode.registry import decoder_name
from decode.runner import PipelineRunner
from feeder.bad_samples import BadSamples, SampleFilter, UnservableSample
from feeder.metrics import ServerMetrics
from feeder.producer import Producer, ReadyBatch, StreamContext
from protocol.plan import BatchSlice, LastBatch, epoch_order, iter_batches, rank_part
from protocol.request import AugmentKind, CropRange
from shards.reader import ShardDataset, SplitIndex
from tests.common.bad_samples import break_scan, copy_shards
from transport.base import Slot, TransportClosed, host_slot

_SIZE = 16  # output side (pixels)
_BATCH = 4
_PREFETCH = 2
_MAX_PIXELS = 1 << 24


@pytest.fixture(params=["auto", "dali"], ids=["default-decoder", "dali"])
def runner(request: pytest.FixtureRequest) -> Iterator[PipelineRunner]:
    """The default CPU pipeline (the window decoder where it was built), and DALI's."""
    runner = PipelineRunner(PipelineSpec(cpu_decoder=request.param, max_batch_size=8, threads=1,
                                         prefetch=_PREFETCH))
    yield runner
    runner.close()


def _split(root: Path, name: str = "val") -> SplitIndex:
    return ShardDataset.open("s", root).splits[name]


def _context(split: SplitIndex, runner: PipelineRunner, on_error: OnError = OnError.SKIP,
             kind: AugmentKind = AugmentKind.VAL, seed: int = 0) -> StreamContext:
    samples = SampleFilter(BadSamples("s", split, _MAX_PIXELS), on_error)
    return StreamContext(split, runner, _SIZE, len(split), samples, queue_batches=2, queue_bytes=1 << 20,
                         kind=kind, seed=seed)


def _slices(split: SplitIndex, batch_size: int = _BATCH, epoch: int = 0, seed: int = 3) -> list[BatchSlice]:
    """One rank's batches of an epoch, shuffled."""
    part = rank_part(epoch_order(len(split), seed, epoch, shuffle=True), 0, 1, LastBatch.DROP)
    return list(iter_batches(part, 0, batch_size, LastBatch.DROP, epoch=epoch))


class _Counted:
    """The slices, counting how many the producer has taken."""

    def __init__(self, slices: Iterable[BatchSlice]) -> None:
        self._slices = iter(slices)
        self.taken = 0

    def __iter__(self) -> _Counted:
        return self

    def __next__(self) -> BatchSlice:
        batch = next(self._slices)
        self.taken += 1
        return batch


class _Slots:
    """Host slots, counted; raises :class:`TransportClosed` once ``closed``."""

    def __init__(self) -> None:
        self.given = 0
        self.closed = False

    def __call__(self, shape: tuple[int, ...]) -> Slot:
        if self.closed:
            raise TransportClosed("the stream was closed")
        self.given += 1
        return host_slot(shape)


def _alone(runner: PipelineRunner, split: SplitIndex, index: int, kind: AugmentKind = AugmentKind.VAL,
           seed: int = 0, epoch: int = 0) -> np.ndarray:
    """Sample ``index`` decoded by itself, its window drawn as the producer draws it."""
    key = split.keys[index]
    crops = sample_crops(kind, seed, epoch, [key], split.widths[[index]], split.heights[[index]], CropRange())
    return runner.run(Job(split.read_many([index]), _SIZE, crops))[0]


def _check_batch(ready: ReadyBatch, batch: BatchSlice, split: SplitIndex) -> None:
    meta = ready.meta
    assert (meta.epoch, meta.cursor, meta.samples_per_rank) == (batch.epoch, batch.cursor, len(split))
    assert meta.keys == [split.keys[int(i)] for i in batch.indices]
    assert np.array_equal(meta.labels, split.labels[batch.indices])
    assert np.array_equal(meta.padding, batch.padding) and meta.failed_keys == []
    assert ready.images.dtype == np.uint8 and tuple(ready.images.shape) == (len(batch.indices), _SIZE, _SIZE, 3)


def test_one_batch_per_slice_in_order_with_each_sample_at_its_position(shards: Path, runner) -> None:
    split = _split(shards)
    slices = _slices(split)
    ready = list(Producer(_context(split, runner), ServerMetrics()).batches(iter(slices), host_slot))
    assert len(ready) == len(slices) == len(split) // _BATCH
    for got, batch in zip(ready, slices):
        _check_batch(got, batch, split)
        for pos, index in enumerate(batch.indices):
            assert np.array_equal(got.images[pos], _alone(runner, split, int(index))), (batch.cursor, pos)


def test_a_samples_pixels_depend_on_seed_epoch_and_key_not_on_its_batch(shards: Path, runner) -> None:
    split = _split(shards, "train")

    def pixels(batch_size: int, epoch: int, seed: int) -> dict[str, np.ndarray]:
        producer = Producer(_context(split, runner, kind=AugmentKind.TRAIN, seed=seed), ServerMetrics())
        slices = _slices(split, batch_size, epoch)[:3]
        return {key: image for ready in producer.batches(iter(slices), host_slot)
                for key, image in zip(ready.meta.keys, np.asarray(ready.images))}

    by_four = pixels(4, epoch=1, seed=5)
    by_two = pixels(2, epoch=1, seed=5)
    assert set(by_two) <= set(by_four)
    assert all(np.array_equal(by_two[key], by_four[key]) for key in by_two)
    index = split.keys.index(next(iter(by_two)))
    key = split.keys[index]
    assert np.array_equal(by_two[key], _alone(runner, split, index, AugmentKind.TRAIN, seed=5, epoch=1))
    # Another seed draws other windows for the same samples of the same epoch.
    other_seed = pixels(2, epoch=1, seed=6)
    assert any(not np.array_equal(other_seed[k], by_two[k]) for k in by_two)


def test_the_producer_reads_only_as_far_ahead_as_the_pipeline_prefetches(shards: Path, runner) -> None:
    split = _split(shards)
    slices = _Counted(itertools.islice(itertools.cycle(_slices(split)), 40))
    slots = _Slots()
    batches = Producer(_context(split, runner), ServerMetrics()).batches(slices, slots)
    ahead = runner.jobs_ahead  # the runs in flight, and the look-ahead's batches on the window decoder
    assert ahead == _PREFETCH + (runner.lookahead if decoder_name(runner.spec) == "libjpeg-turbo" else 0)
    for taken in range(1, 6):
        next(batches)
        # Those and one slice of read-ahead; a slot only per batch handed out.
        assert slices.taken <= taken + ahead + 1, (taken, slices.taken)
        assert slots.given == taken
    batches.close()
    assert slices.taken <= 5 + ahead + 1


def test_a_consumer_that_stops_leaves_the_runner_to_the_next_stream(shards: Path, runner) -> None:
    split = _split(shards)
    slices = _Counted(itertools.chain(_slices(split), _slices(split, epoch=2)))
    batches = Producer(_context(split, runner), ServerMetrics()).batches(slices, host_slot)
    next(batches)
    batches.close()  # the consumer went away with runs in flight
    taken = slices.taken
    assert taken < 2 * len(split) // _BATCH
    with pytest.raises(StopIteration):
        next(batches)
    assert slices.taken == taken
    runner.drain()  # what the pipeline pool does when the stream gives it back
    assert not runner.broken
    later = _slices(split, epoch=1)
    ready = list(Producer(_context(split, runner), ServerMetrics()).batches(iter(later), host_slot))
    for got, batch in zip(ready, later, strict=True):
        _check_batch(got, batch, split)
        assert np.array_equal(got.images[0], _alone(runner, split, int(batch.indices[0])))


def test_a_transport_closed_while_the_producer_waits_for_a_slot_ends_it(shards: Path, runner) -> None:
    split = _split(shards)
    slots = _Slots()
    batches = Producer(_context(split, runner), ServerMetrics()).batches(iter(_slices(split)), slots)
    next(batches)
    slots.closed = True
    with pytest.raises(TransportClosed):
        next(batches)
    assert not runner.broken and slots.given == 1


def _where(slices: list[BatchSlice], index: int) -> tuple[int, int]:
    """(batch number, position) of sample ``index`` in ``slices``."""
    return next((n, int(np.flatnonzero(s.indices == index)[0])) for n, s in enumerate(slices) if index in s.indices)


def test_under_skip_an_undecodable_sample_is_replaced_in_its_batch_and_named(shards: Path, tmp_path: Path,
                                                                              runner) -> None:
    root = copy_shards(shards, tmp_path / "shards")
    row = 5
    key = break_scan(root, "val", row)
    split = _split(root)
    slices = _slices(split)
    metrics = ServerMetrics()
    context = _context(split, runner)
    ready = list(Producer(context, metrics).batches(iter(slices), host_slot))
    number, pos = _where(slices, row)
    assert [r.meta.cursor for r in ready] == [s.cursor for s in slices]
    for n, (got, batch) in enumerate(zip(ready, slices)):
        if n != number:
            _check_batch(got, batch, split)
    hit = ready[number]
    assert hit.meta.failed_keys == [key]
    assert hit.meta.padding[pos] and hit.meta.padding.sum() == 1
    donor = hit.meta.keys[pos]
    assert donor != key and donor in hit.meta.keys[:pos] + hit.meta.keys[pos + 1:]
    twin = hit.meta.keys.index(donor)
    assert np.array_equal(hit.images[pos], hit.images[twin]) and hit.meta.labels[pos] == hit.meta.labels[twin]
    assert metrics.registry.get_sample_value("feeder_samples_failed_total", {"dataset": "s", "split": "val"}) == 1
    assert context.samples.bad.reason(row) is not None
    # Known now: the next epoch replaces it before reading or decoding it.
    again = _slices(split, epoch=1)
    number, _ = _where(again, row)
    retries = metrics.registry.get_sample_value("feeder_decode_retries_total")
    ready = list(Producer(context, metrics).batches(iter(again), host_slot))
    assert ready[number].meta.failed_keys == [key]
    assert metrics.registry.get_sample_value("feeder_decode_retries_total") == retries


def test_under_fail_an_undecodable_sample_ends_the_batches_naming_it(shards: Path, tmp_path: Path, runner) -> None:
    root = copy_shards(shards, tmp_path / "shards")
    row = 9
    key = break_scan(root, "val", row)
    split = _split(root)
    slices = _slices(split)
    number, _ = _where(slices, row)
    batches = Producer(_context(split, runner, OnError.FAIL), ServerMetrics()).batches(iter(slices), host_slot)
    delivered = list(itertools.islice(batches, number))
    assert [r.meta.cursor for r in delivered] == [s.cursor for s in slices[:number]]
    with pytest.raises(UnservableSample, match=f"val/{key}: does not decode"):
        next(batches)


def _change_bytes(root: Path, split: SplitIndex, index: int) -> None:
    """Sample ``index``'s bytes changed in its tar after sharding (the index keeps
    their old checksum)."""
    offset, size = split.location(index)
    with open(root / split.shard_of(index), "r+b") as f:
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("on_error", [OnError.SKIP, OnError.FAIL])
def test_a_sample_whose_bytes_changed_is_bad_data_under_the_policy(shards: Path, tmp_path: Path, runner,
                                                                   on_error: OnError) -> None:
    root = copy_shards(shards, tmp_path / "shards")
    split = _split(root)
    row = 2
    _change_bytes(root, split, row)
    slices = _slices(split)
    number, pos = _where(slices, row)
    batches = Producer(_context(split, runner, on_error), ServerMetrics()).batches(iter(slices), host_slot)
    if on_error is OnError.FAIL:
        delivered: list[ReadyBatch] = []
        with pytest.raises(SampleCorrupt, match=split.keys[row]):
            delivered.extend(batches)
        # Its bytes are read ahead of the batches in flight: the stream ends before
        # its batch, having delivered only batches before it, in order.
        assert [r.meta.cursor for r in delivered] == [s.cursor for s in slices[:len(delivered)]]
        assert len(delivered) <= number
        return
    ready = list(batches)
    assert len(ready) == len(slices)
    assert ready[number].meta.failed_keys == [split.keys[row]] and ready[number].meta.padding[pos]
