"""The DALI boundary: each shape of DALI's error text, read into a failure with its
positions as data (the strings are DALI's own, as nvidia-dali 1.5x words them)."""

from __future__ import annotations

import numpy as np
import pytest

from core.workers import FairPool
from decode.dali import DaliCpuDecoder
from decode.jobs import SampleDecodeError
from decode.pipeline import PipelineSpec, dali_decode_error
from tests.common.jobs import header_job, jpeg_bytes

_TRACEBACK = (
    "Critical error in pipeline:\nError in CPU operator `nvidia.dali.fn.decoders.image_slice`,\n"
    "which was used in the pipeline definition with the following traceback:\n\n"
    '  File "/work/decode/pipeline.py", line 100, in crop_decode_pipeline\n\nencountered:\n\n'
)
_TAIL = "\nCurrent pipeline object is no longer valid.\nCurrent pipeline object is no longer valid."


def test_a_named_sample_with_no_reason():
    error = dali_decode_error(RuntimeError(_TRACEBACK + "Failed to decode sample #1 : " + _TAIL), 3)
    assert error.failures == {1: "DALI gave no reason"}


def test_a_named_sample_with_its_reason():
    error = dali_decode_error(RuntimeError(_TRACEBACK + "Failed to decode sample #2 : bad Huffman code" + _TAIL), 4)
    assert error.failures == {2: "bad Huffman code"}


def test_an_error_code_is_not_a_sample():
    error = dali_decode_error(RuntimeError(_TRACEBACK + "nvImageCodec failure: '#4'" + _TAIL), 8)
    assert error.failures is None and error.detail == "nvImageCodec failure: '#4'"


def test_a_sample_number_past_the_batch_names_none():
    error = dali_decode_error(RuntimeError(_TRACEBACK + "Failed to decode sample #9 : x" + _TAIL), 3)
    assert error.failures is None


def test_a_message_without_a_traceback_keeps_its_first_line():
    error = dali_decode_error(RuntimeError("something else broke\nmore"), 3)
    assert error.failures is None and error.detail == "something else broke"


@pytest.mark.parametrize("bad,named", [
    (lambda good: good[: len(good) // 2].copy(), True),  # truncated: DALI names the sample
    (lambda good: np.frombuffer(b"not a jpeg" * 10, np.uint8), False),  # garbage: an error code only
])
def test_real_dali_errors_read_as_their_shape(bad, named):
    good = jpeg_bytes(64, 48, 0)
    workers = FairPool(1)
    decoder = DaliCpuDecoder(PipelineSpec(cpu_decoder="dali", max_batch_size=4, threads=1), workers.lane())
    try:
        with pytest.raises(SampleDecodeError) as caught:
            decoder.finish(decoder.start(header_job([good, bad(good), good], 16)), None)
    finally:
        decoder.close()
        workers.close()
    assert (caught.value.failures == {1: "DALI gave no reason"}) if named else caught.value.failures is None
