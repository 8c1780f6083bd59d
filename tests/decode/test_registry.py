"""The decoder registry (:mod:`decode.registry`): a name to a class, the choice made by
``--cpu-decoder`` and the device. A decoder that exists only in this file (OpenCV's
whole-image decode, the window cut out of it) is registered with one line, and a daemon
started with its name serves every stream with it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import cv2
import numpy as np
import pytest

from core.errors import ConfigError
from core.workers import Lane
from decode.dali import DaliCpuDecoder, DaliGpuDecoder
from decode.decoder import PhasedDecoder, batch_shape
from decode.finish import Finisher
from decode.jobs import Job, SampleDecodeError
from decode.pipeline import PipelineSpec
from decode.registry import DECODERS, check_cpu_decoder, cpu_decoders, decoder_name, make_decoder
from decode.turbo import TurboDecoder
from feeder.config import ServerConfig
from protos import feeder_pb2, feeder_pb2_grpc
from shards import jpeg
from tests.feeder.conftest import connect, start
from transport.base import Slot


class OpenCvDecoder(PhasedDecoder):
    """OpenCV decodes each whole JPEG on the lane and its window is cut out; the
    finishing stage does the rest. Counts the batches it decoded, all instances."""

    batches = 0

    def __init__(self, spec: PipelineSpec, lane: Lane) -> None:
        self._lane = lane
        self._finisher = Finisher(lane, spec.antialias)

    def start(self, job: Job) -> tuple[Job, list[Any], dict[int, str]]:
        windows: list[Any] = [None] * len(job)
        failed: dict[int, str] = {}

        def one(i: int) -> None:
            image = cv2.imdecode(job.jpegs[i], cv2.IMREAD_COLOR_RGB | cv2.IMREAD_IGNORE_ORIENTATION)
            if image is None:
                failed[i] = "OpenCV cannot decode it"
                return
            x, y, w, h = (int(v) for v in job.crops.boxes[i])
            windows[i] = image[y:y + h, x:x + w]

        self._lane.run(one, len(job))
        type(self).batches += 1
        return job, windows, failed

    def collect(self, started: tuple[Job, list[Any], dict[int, str]]) -> tuple[Job, list[Any]]:
        job, windows, failed = started
        if failed:
            raise SampleDecodeError(failed[min(failed)], failed)
        return job, windows

    def shape(self, collected: tuple[Job, list[Any]]) -> tuple[int, int, int, int]:
        return batch_shape(collected[0])

    def write(self, collected: tuple[Job, list[Any]], slot: Slot) -> None:
        job, windows = collected
        self._finisher.finish(windows, job.image_size, job.crops, out=slot.array)


def test_the_names_are_the_registrys_and_auto_takes_the_first_cpu_decoder_that_runs() -> None:
    assert DECODERS == {"libjpeg-turbo": TurboDecoder, "dali": DaliCpuDecoder, "nvjpeg": DaliGpuDecoder}
    assert cpu_decoders() == ("auto", "libjpeg-turbo", "dali")
    assert decoder_name(PipelineSpec()) == ("libjpeg-turbo" if jpeg.available() else "dali")
    assert decoder_name(PipelineSpec(cpu_decoder="dali")) == "dali"
    assert decoder_name(PipelineSpec(device="gpu")) == "nvjpeg"  # the device picks, whatever the CPU's choice


def test_a_name_the_registry_lacks_is_refused_naming_those_it_has(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cpu_decoder: 'opencv' is not one of auto, libjpeg-turbo, dali$"):
        check_cpu_decoder("opencv")
    with pytest.raises(ConfigError, match="cpu_decoder: 'opencv'"):
        ServerConfig.of(datasets={"d": tmp_path}, cpu_decoder="opencv")
    with pytest.raises(ConfigError, match="nvjpeg"):  # a GPU decoder is no CPU choice
        check_cpu_decoder("nvjpeg")


def test_a_decoder_the_registry_says_cannot_run_here_is_refused_naming_why(monkeypatch) -> None:
    monkeypatch.setattr(TurboDecoder, "unavailable_reason", classmethod(lambda cls: "not built (test)"))
    with pytest.raises(ConfigError, match="cpu_decoder: libjpeg-turbo: not built \\(test\\)"):
        check_cpu_decoder("libjpeg-turbo")
    assert decoder_name(PipelineSpec()) == "dali"


def test_a_registered_decoder_is_made_by_its_name(monkeypatch, tmp_path: Path) -> None:
    from core.workers import FairPool

    monkeypatch.setitem(DECODERS, "opencv", OpenCvDecoder)
    workers = FairPool(1, name="t-registry")
    try:
        decoder = make_decoder(PipelineSpec(cpu_decoder="opencv", max_batch_size=4, threads=1), workers.lane())
    finally:
        workers.close()
    assert type(decoder) is OpenCvDecoder
    assert cpu_decoders() == ("auto", "libjpeg-turbo", "dali", "opencv")
    assert decoder_name(PipelineSpec()) != "opencv"  # auto keeps the registry's order


def _batches(port: int, **fields: Any) -> list[feeder_pb2.Batch]:
    request = feeder_pb2.StreamRequest(dataset="sample", split="train", world_size=1, batch_size=8, image_size=32,
                                       seed=3, **fields)
    with connect(port) as channel:
        return list(feeder_pb2_grpc.FeederStub(channel).StreamBatches(request, timeout=60))


def _pixels(batches: list[feeder_pb2.Batch]) -> np.ndarray:
    return np.concatenate([np.frombuffer(b.images, np.uint8).reshape(tuple(b.shape)) for b in batches])


@pytest.mark.slow
def test_a_decoder_registered_with_one_line_serves_a_daemons_streams(monkeypatch, shards: Path) -> None:
    monkeypatch.setitem(DECODERS, "opencv", OpenCvDecoder)  # the one line a new decoder needs
    before = OpenCvDecoder.batches
    served = {}
    for name in ("opencv", "dali"):  # DALI decodes whole-scale windows too, with the same libjpeg-turbo IDCT
        server, port = start({"sample": shards}, cpu_decoder=name)
        try:
            served[name] = _batches(port)
        finally:
            server.stop(0).wait(10)
    assert OpenCvDecoder.batches - before == len(served["opencv"]) > 0
    assert [list(b.keys) for b in served["opencv"]] == [list(b.keys) for b in served["dali"]]
    diff = np.abs(_pixels(served["opencv"]).astype(int) - _pixels(served["dali"]))
    assert diff.mean() < 1.0 and np.percentile(diff, 99) <= 8, "the same windows, finished alike"
