"""The decoders (:mod:`decode.turbo`, :mod:`decode.dali`), each a real one on real JPEGs: the CPU ones
on DALI's CPU pipeline and the libjpeg-turbo window decoder, the GPU one where there
is a device. Each run's batch is uint8 ``[N, size, size, 3]`` with sample ``i``'s
window at ``i``, mirrored where its flip says; runs finish in the order they were
started, a run whose samples do not decode raises naming them, and the runs behind
it still come out right."""

from __future__ import annotations

import io
from collections.abc import Iterator, Sequence

import numpy as np
import pytest
import torch
from PIL import Image

from core.workers import FairPool, Lane
from decode.augment import Crops, centre_crops
from decode.dali import DaliCpuDecoder, DaliGpuDecoder
from decode.decoder import Decoder
from decode.jobs import Allocate, Job, SampleDecodeError
from decode.pipeline import PipelineSpec
from decode.registry import make_decoder
from decode.turbo import TurboDecoder
from shards import jpeg
from tests.common.bad_samples import broken_scan
from transport.base import Slot, host_slot

_SIZE = 16  # output side (pixels)
_COLOURS = [(200, 30, 30), (30, 200, 30), (30, 30, 200), (220, 220, 40), (40, 220, 220)]
_RED, _BLUE = (220, 20, 20), (20, 20, 220)
_CPU_DECODERS = [
    pytest.param("dali", id="dali"),
    pytest.param("libjpeg-turbo", id="libjpeg-turbo", marks=pytest.mark.skipif(
        not jpeg.available(), reason=str(jpeg.unavailable_reason()))),
]


def _jpeg(pixels: np.ndarray) -> np.ndarray:
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return np.frombuffer(out.getvalue(), dtype=np.uint8)


def _solid(colour: Sequence[int], width: int = 64, height: int = 48) -> np.ndarray:
    """A JPEG of one colour."""
    return _jpeg(np.full((height, width, 3), colour, dtype=np.uint8))


def _halves(width: int = 64, height: int = 48) -> np.ndarray:
    """A JPEG red on its left half, blue on its right."""
    pixels = np.empty((height, width, 3), dtype=np.uint8)
    pixels[:, : width // 2], pixels[:, width // 2:] = _RED, _BLUE
    return _jpeg(pixels)


def _job(jpegs: Sequence[np.ndarray], flips: Sequence[bool] | None = None, width: int = 64, height: int = 48) -> Job:
    """Centre windows of JPEGs of ``width`` x ``height``, mirrored where ``flips`` says."""
    crops = centre_crops(np.full(len(jpegs), width), np.full(len(jpegs), height))
    if flips is not None:
        crops = Crops(boxes=crops.boxes, flips=np.array(flips, dtype=bool))
    return Job(list(jpegs), _SIZE, crops)


def _colours(batch: np.ndarray) -> np.ndarray:
    """Mean colour of each image of a batch."""
    return batch.reshape(len(batch), -1, 3).mean(axis=1)


def _assert_colours(batch: np.ndarray, colours: Sequence[Sequence[int]]) -> None:
    assert np.abs(_colours(batch) - np.array(colours, dtype=float)).max() < 8, _colours(batch)


class _Slots:
    """An ``allocate`` handing out host slots, counting them."""

    def __init__(self) -> None:
        self.shapes: list[tuple[int, ...]] = []

    def __call__(self, shape: tuple[int, ...]) -> Slot:
        self.shapes.append(shape)
        return host_slot(shape)


@pytest.fixture
def lane() -> Iterator[Lane]:
    workers = FairPool(1, name="t-decoders")
    yield workers.lane("decoder")
    workers.close()


@pytest.fixture(params=_CPU_DECODERS)
def cpu_decoder(request: pytest.FixtureRequest, lane: Lane) -> Iterator[Decoder]:
    """Each CPU decoder, as :func:`make_decoder` chooses it for its spec, on DALI's
    CPU pipeline (no device) where it is DALI's; three runs may be in flight."""
    decoder = make_decoder(PipelineSpec(cpu_decoder=request.param, max_batch_size=8, threads=1, prefetch=3), lane)
    yield decoder
    decoder.close()


def _finished(decoder: Decoder, started: object, allocate: Allocate = host_slot) -> np.ndarray:
    slot = decoder.finish(started, allocate)
    assert slot is not None
    return slot.array


def _run(decoder: Decoder, job: Job, allocate: Allocate = host_slot) -> np.ndarray:
    return _finished(decoder, decoder.start(job), allocate)


@pytest.mark.parametrize("name,kind", [("dali", DaliCpuDecoder), ("libjpeg-turbo", TurboDecoder)])
def test_the_spec_chooses_the_decoder(lane: Lane, name: str, kind: type) -> None:
    if kind is TurboDecoder and not jpeg.available():
        pytest.skip(str(jpeg.unavailable_reason()))
    decoder = make_decoder(PipelineSpec(cpu_decoder=name, max_batch_size=2, threads=1), lane)
    decoder.close()
    assert type(decoder) is kind
    assert decoder.device_copies == decoder.host_copies == 0


def test_a_batch_is_uint8_nhwc_with_each_sample_at_its_position(cpu_decoder: Decoder) -> None:
    slots = _Slots()
    batch = _run(cpu_decoder, _job([_solid(c) for c in _COLOURS]), slots)
    assert slots.shapes == [(len(_COLOURS), _SIZE, _SIZE, 3)]
    assert batch.dtype == np.uint8 and batch.shape == (len(_COLOURS), _SIZE, _SIZE, 3)
    _assert_colours(batch, _COLOURS)


def test_only_the_window_is_decoded_and_a_flip_mirrors_it(cpu_decoder: Decoder) -> None:
    image = _halves()
    left_half = Job([image], _SIZE, Crops(boxes=np.array([[0, 0, 32, 48]], dtype=np.int32),
                                          flips=np.zeros(1, dtype=bool)))
    _assert_colours(_run(cpu_decoder, left_half), [_RED])
    batch = _run(cpu_decoder, _job([image, image], flips=[False, True]))
    quarter = _SIZE // 4
    kept, mirrored = batch[0], batch[1]
    _assert_colours(kept[None, :, :quarter], [_RED])
    _assert_colours(kept[None, :, -quarter:], [_BLUE])
    _assert_colours(mirrored[None, :, :quarter], [_BLUE])
    _assert_colours(mirrored[None, :, -quarter:], [_RED])
    assert np.array_equal(mirrored, kept[:, ::-1])


def test_runs_finish_in_the_order_they_were_started(cpu_decoder: Decoder) -> None:
    runs = [[_COLOURS[k], _COLOURS[k + 1]] for k in range(3)]
    started = [cpu_decoder.start(_job([_solid(c) for c in colours])) for colours in runs]
    for begun, colours in zip(started, runs):
        _assert_colours(_finished(cpu_decoder, begun), colours)


def test_a_run_nobody_wants_takes_no_slot(cpu_decoder: Decoder) -> None:
    slots = _Slots()
    assert cpu_decoder.finish(cpu_decoder.start(_job([_solid(_COLOURS[0])])), None) is None
    _assert_colours(_run(cpu_decoder, _job([_solid(_COLOURS[1])]), slots), [_COLOURS[1]])
    assert len(slots.shapes) == 1


def test_an_undecodable_sample_fails_its_run_and_the_runs_behind_it_come_out(cpu_decoder: Decoder) -> None:
    good = [_solid(c) for c in _COLOURS[:3]]
    bad = broken_scan(good[1].tobytes())
    first = cpu_decoder.start(_job(good[:1]))
    failing = cpu_decoder.start(_job([good[0], np.frombuffer(bad, dtype=np.uint8), good[2]]))
    behind = cpu_decoder.start(_job(good[1:]))
    slots = _Slots()
    _assert_colours(_finished(cpu_decoder, first, slots), _COLOURS[:1])
    with pytest.raises(SampleDecodeError) as caught:
        cpu_decoder.finish(failing, slots)
    # The window decoder names the sample; DALI names it or gives an error code only
    # (then the runner finds it: decode.jobs.locate_failures).
    assert caught.value.failures is None or set(caught.value.failures) == {1}
    assert len(slots.shapes) == 1  # a failed run writes nothing
    _assert_colours(_finished(cpu_decoder, behind, slots), _COLOURS[1:3])


@pytest.mark.skipif(not jpeg.available(), reason=str(jpeg.unavailable_reason()))
def test_the_window_decoder_names_every_sample_that_fails(lane: Lane) -> None:
    decoder = TurboDecoder(PipelineSpec(cpu_decoder="libjpeg-turbo", max_batch_size=8, threads=1), lane)
    good = _solid(_COLOURS[0])
    garbage = np.frombuffer(b"not a jpeg" * 20, dtype=np.uint8)
    broken = np.frombuffer(broken_scan(good.tobytes()), dtype=np.uint8)
    try:
        with pytest.raises(SampleDecodeError) as caught:
            _run(decoder, _job([good, garbage, good, broken]))
    finally:
        decoder.close()
    assert set(caught.value.failures or ()) == {1, 3}
    assert "and 1 more" in caught.value.detail


def test_a_decoder_runs_again_after_giving_back_its_buffers(cpu_decoder: Decoder) -> None:
    _run(cpu_decoder, _job([_solid(c) for c in _COLOURS]))
    cpu_decoder.release_buffers()
    _assert_colours(_run(cpu_decoder, _job([_solid(c) for c in _COLOURS[::-1]])), _COLOURS[::-1])


@pytest.mark.gpu
@pytest.mark.parametrize("on_device", [False, True], ids=["host-slot", "device-slot"])
def test_the_gpu_decoder_writes_where_the_slot_is(on_device: bool) -> None:
    decoder = DaliGpuDecoder(PipelineSpec(device="gpu", device_id=0, max_batch_size=8, threads=1))
    shape = (len(_COLOURS), _SIZE, _SIZE, 3)
    pixels = torch.empty(shape, dtype=torch.uint8, device="cuda:0") if on_device else np.empty(shape, np.uint8)
    try:
        slot = decoder.finish(decoder.start(_job([_solid(c) for c in _COLOURS], flips=[True] * 5)),
                              lambda s: Slot(pixels=pixels))
    finally:
        decoder.close()
    assert slot is not None and slot.pixels is pixels
    _assert_colours(pixels.cpu().numpy() if on_device else pixels, _COLOURS)
    assert (decoder.device_copies, decoder.host_copies) == ((1, 0) if on_device else (0, 1))
