"""The GPU's counters during a timed window (``bench/nvml.py``): NVML where its library
loads, else ``nvidia-smi --query-gpu`` (here a script standing in for the driver's
tool, printing what it prints), else nothing, said in one line."""

from __future__ import annotations

import ctypes
import os
import time
from pathlib import Path

import pytest

from bench.nvml import Utilization, WindowSampler, card_kind, open_reader


@pytest.fixture
def no_nvml() -> None:
    try:
        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return
    pytest.skip("NVML's library loads here: the readings come from the driver")


def _smi(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, output: str, status: int = 0) -> None:
    tool = tmp_path / "nvidia-smi"
    tool.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\nexit {status}\n")
    tool.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")


def _sampled(interval_s: float = 0.01) -> Utilization:
    sampler = WindowSampler(*open_reader(), interval_s=interval_s)
    sampler.start()
    time.sleep(0.1)
    return sampler.stop()


def test_without_nvml_or_nvidia_smi_nothing_is_read_and_the_reason_is_one_line(
        no_nvml: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # no nvidia-smi on it
    reader, reason = open_reader()
    assert reader is None and reason.startswith("no NVML (") and reason.endswith("and no nvidia-smi")
    counters = _sampled()
    assert (counters.gpu_percent, counters.jpeg_percent, counters.samples) == (None, None, 0)
    assert counters.reason == f"not available: {reason}" and "\n" not in counters.reason


def test_nvidia_smis_readings_are_averaged_over_the_window(
        no_nvml: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _smi(tmp_path, monkeypatch, "87, 12")
    counters = _sampled()
    assert counters.samples >= 1 and counters.source == "nvidia-smi" and counters.reason == ""
    assert (counters.gpu_percent, counters.jpeg_percent) == (87.0, 12.0)


def test_a_card_without_jpeg_engines_reads_none_for_them_and_says_why(
        no_nvml: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _smi(tmp_path, monkeypatch, "64, [N/A]")
    counters = _sampled()
    assert (counters.gpu_percent, counters.jpeg_percent) == (64.0, None)
    assert counters.reason == "JPEG engines: the card has no JPEG engines"


def test_a_driver_that_does_not_know_the_field_is_no_reader(
        no_nvml: None, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _smi(tmp_path, monkeypatch, 'Field "utilization.jpeg" is not a valid field to query.', status=2)
    reader, reason = open_reader()
    assert reader is None and "is not a valid field" in reason


def test_the_lent_kinds_are_named_from_the_cards_name() -> None:
    assert card_kind("NVIDIA H200") == "H200" and card_kind("NVIDIA H100 80GB HBM3") == "H100"
    assert card_kind("") == "no GPU" and card_kind("Tesla T4") == "Tesla T4"
