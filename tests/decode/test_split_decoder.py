"""A batch split between two decoders (:mod:`decode.split_decoder`), on the CPU: the
window decoder takes the first rows, DALI's CPU decoder the rest, both real; each row
holds the same pixels the decoder that took it makes alone, failures are named by
their position in the whole batch, and the share follows what the runs show."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest

from core.workers import FairPool, Lane
from decode.dali import DaliCpuDecoder
from decode.jobs import SampleDecodeError
from decode.pipeline import PipelineSpec
from decode.registry import make_decoder
from decode.split_decoder import LATE_S, STEP, CpuShare, SplitDecoder
from decode.turbo import TurboDecoder
from shards import jpeg
from tests.common.bad_samples import broken_scan
from tests.decode.test_decoders import _COLOURS, _job, _solid
from transport.base import host_slot

pytestmark = pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))

_SPEC = PipelineSpec(max_batch_size=8, threads=1, prefetch=2)


@pytest.fixture
def lane() -> Iterator[Lane]:
    workers = FairPool(1, name="t-split")
    yield workers.lane("split")
    workers.close()


@pytest.fixture
def halves(lane: Lane) -> Iterator[tuple[TurboDecoder, DaliCpuDecoder]]:
    cpu, other = TurboDecoder(_SPEC, lane), DaliCpuDecoder(_SPEC, lane)
    yield cpu, other
    cpu.close()
    other.close()


def _alone(decoder, job) -> np.ndarray:  # type: ignore[no-untyped-def]
    slot = decoder.finish(decoder.start(job), host_slot)
    assert slot is not None
    return slot.array.copy()


def test_each_row_holds_what_the_decoder_that_took_it_makes(halves, lane) -> None:  # type: ignore[no-untyped-def]
    cpu, other = halves
    job = _job([_solid(c) for c in _COLOURS], flips=[False, True, False, True, False])
    split = SplitDecoder(cpu, other, CpuShare(0.4))  # 2 of 5 rows on the window decoder
    slot = split.finish(split.start(job), host_slot)
    assert slot is not None and slot.array.shape == (5, 16, 16, 3)
    assert np.array_equal(slot.array[:2], _alone(TurboDecoder(_SPEC, lane), job.only(range(2))))
    assert np.array_equal(slot.array[2:], _alone(DaliCpuDecoder(_SPEC, lane), job.only(range(2, 5))))
    assert (split.cpu_samples, split.gpu_samples) == (2, 3)


@pytest.mark.parametrize("share,rows", [(0.0, 0), (1.0, 5)], ids=["none-on-cpu", "all-on-cpu"])
def test_a_part_without_rows_is_not_run(halves, share: float, rows: int) -> None:  # type: ignore[no-untyped-def]
    split = SplitDecoder(*halves, CpuShare(share))
    slot = split.finish(split.start(_job([_solid(c) for c in _COLOURS])), host_slot)
    assert slot is not None and slot.array.shape[0] == 5
    assert (split.cpu_samples, split.gpu_samples) == (rows, 5 - rows)


def test_failures_are_named_by_their_position_in_the_batch(halves) -> None:  # type: ignore[no-untyped-def]
    good = [_solid(c) for c in _COLOURS]
    bad = np.frombuffer(broken_scan(good[0].tobytes()), dtype=np.uint8)
    split = SplitDecoder(*halves, CpuShare(0.4))  # rows 0-1 on the CPU, 2-4 on the other
    taken: list[tuple[int, ...]] = []
    with pytest.raises(SampleDecodeError) as caught:
        split.finish(split.start(_job([good[0], bad, good[2], good[3], bad])),
                     lambda shape: taken.append(shape) or host_slot(shape))
    assert taken == []  # a failed run takes no slot
    # The window decoder names its sample; DALI names it or only says the run failed
    # (the runner then finds it).
    assert set(caught.value.failures or ()) in ({1, 4}, {1})
    after = split.finish(split.start(_job(good)), host_slot)  # both halves run on
    assert after is not None


def test_a_gpu_spec_with_a_cpu_share_splits_only_on_a_gpu(lane: Lane) -> None:
    decoder = make_decoder(PipelineSpec(max_batch_size=4, threads=1, cpu_decode_share=None), lane)
    decoder.close()
    assert type(decoder) is TurboDecoder  # the CPU path ignores it


def test_the_share_grows_while_the_cpu_keeps_up_and_shrinks_when_it_is_late() -> None:
    share = CpuShare(None)
    assert share.value == 0.0 and share.rows(256) == 0  # where the GPU decoder was before
    for _ in range(16):
        share.observe(share.rows(256), 0.0)
    assert share.value == pytest.approx(16 * STEP) and share.rows(256) == 64
    share.observe(64, LATE_S * 10)
    assert share.value == pytest.approx(15 * STEP) and (share.late, share.on_time) == (1, 16)
    for _ in range(200):
        share.observe(share.rows(256), 0.0)
    assert share.value == 1.0 and share.rows(256) == 256
    share.observe(0, 1.0)  # no rows on the CPU: it cannot have been late
    assert share.late == 1


def test_a_share_given_by_hand_is_kept() -> None:
    share = CpuShare(0.25)
    for late in (0.0, 1.0, 0.0):
        share.observe(share.rows(8), late)
    assert share.value == 0.25 and share.rows(8) == 2 and share.late == 1
