"""What the GPU's own counters say while a window is timed: the share of time its
kernels ran (``gpu``) and its hardware JPEG engines were busy (``jpeg``), read from
NVML through ctypes (no pynvml needed), or from ``nvidia-smi --query-gpu`` where
NVML's library cannot be loaded.

DALI's ``mixed`` decoder gives the JPEG engines their share of each batch
(``hw_decoder_load``) only where nvJPEG's hardware backend is usable; in a container
without the driver's video capability, or for JPEGs the engines refuse, it decodes on
the SMs instead and says nothing. The engines' utilisation during a fed window tells
which: 0 % means they were not used. Where neither NVML nor nvidia-smi answers (a
machine without a GPU), every reading is None with the reason.
"""

from __future__ import annotations

import ctypes
import shutil
import statistics
import subprocess
import threading
from dataclasses import dataclass
from typing import Protocol

__all__ = ["CounterReader", "Utilization", "WindowSampler", "card_kind", "open_reader"]

_NOT_SUPPORTED = 3  # NVML_ERROR_NOT_SUPPORTED: the card has no such engine or counter
_SMI_FIELDS = "utilization.gpu,utilization.jpeg"


@dataclass(frozen=True)
class Utilization:
    """A window's mean readings, percent of the time busy (None: not read).

    Attributes:
        gpu_percent: the SMs' (NVML's ``gpu`` utilisation: some kernel running).
        jpeg_percent: the hardware JPEG engines'; None where the card has none.
        samples: readings averaged.
        source: ``nvml``, ``nvidia-smi``, or empty where nothing could be read.
        reason: why a figure is None (empty when both were read).
    """

    gpu_percent: float | None = None
    jpeg_percent: float | None = None
    samples: int = 0
    source: str = ""
    reason: str = ""


class CounterReader(Protocol):
    """One reading of a GPU's counters: ``(gpu %, jpeg %)``, None where not supported."""

    source: str
    jpeg_reason: str

    def read(self) -> tuple[float | None, float | None]: ...


class _NvmlStruct(ctypes.Structure):
    _fields_ = [("gpu", ctypes.c_uint), ("memory", ctypes.c_uint)]


class _Nvml:
    """NVML's C library, one device."""

    source = "nvml"

    def __init__(self, uuid: str, index: int) -> None:
        self._lib = ctypes.CDLL("libnvidia-ml.so.1")
        self._check(self._lib.nvmlInit_v2(), "nvmlInit")
        self._handle = ctypes.c_void_p()
        found = self._lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(self._handle)) if uuid else 1
        if found != 0:
            self._check(self._lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)), "device")
        self.jpeg_reason = ""

    def _check(self, status: int, what: str) -> None:
        if status != 0:
            self._lib.nvmlErrorString.restype = ctypes.c_char_p
            raise OSError(f"NVML {what}: {self._lib.nvmlErrorString(status).decode()}")

    def read(self) -> tuple[float | None, float | None]:
        rates = _NvmlStruct()
        gpu = float(rates.gpu) if self._lib.nvmlDeviceGetUtilizationRates(self._handle, ctypes.byref(rates)) == 0 \
            else None
        value, period = ctypes.c_uint(), ctypes.c_uint()
        status = self._lib.nvmlDeviceGetJpgUtilization(self._handle, ctypes.byref(value), ctypes.byref(period))
        if status == 0:
            return gpu, float(value.value)
        self.jpeg_reason = "the card has no JPEG engines" if status == _NOT_SUPPORTED else f"NVML status {status}"
        return gpu, None


class _Smi:
    """``nvidia-smi --query-gpu``, one device (a process per reading: slower, same figures)."""

    source = "nvidia-smi"

    def __init__(self, index: int) -> None:
        self._command = ["nvidia-smi", "-i", str(index), f"--query-gpu={_SMI_FIELDS}", "--format=csv,noheader,nounits"]
        self.jpeg_reason = ""
        self.read()  # fails here where the fields are unknown to this driver

    def read(self) -> tuple[float | None, float | None]:
        done = subprocess.run(self._command, capture_output=True, text=True, timeout=5)
        if done.returncode != 0:
            raise OSError(f"nvidia-smi: {(done.stdout + done.stderr).strip().splitlines()[:1]}")
        gpu, jpeg = (_percent(field) for field in done.stdout.strip().split(","))
        if jpeg is None:
            self.jpeg_reason = "the card has no JPEG engines"
        return gpu, jpeg


def _percent(field: str) -> float | None:
    try:
        return float(field.strip())
    except ValueError:
        return None  # "[N/A]", "[Not Supported]"


def open_reader(uuid: str = "", index: int = 0) -> tuple[CounterReader | None, str]:
    """A reader of the GPU ``uuid`` (``GPU-...``; else the one NVML numbers ``index``):
    NVML's library, else nvidia-smi; or None and why neither answers."""
    try:
        return _Nvml(uuid, index), ""
    except (OSError, AttributeError) as e:
        nvml_error = str(e)
    if shutil.which("nvidia-smi") is None:
        return None, f"no NVML ({nvml_error}) and no nvidia-smi"
    try:
        return _Smi(index), ""
    except (OSError, ValueError, subprocess.SubprocessError) as e:
        return None, f"no NVML ({nvml_error}); nvidia-smi: {e}"


class WindowSampler:
    """Reads the counters every ``interval_s`` on a thread of its own between
    :meth:`start` and :meth:`stop` (a timed window), and averages them.

    Args:
        reader: what reads them, or None (nothing to read: :meth:`stop` says why).
        reason: why there is no reader.
        interval_s: time between readings (NVML's own averaging period is about as long).
    """

    def __init__(self, reader: CounterReader | None, reason: str = "", interval_s: float = 0.1) -> None:
        self._reader, self._reason, self._interval_s = reader, reason, interval_s
        self._readings: list[tuple[float | None, float | None]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begins reading (nothing without a reader)."""
        self._readings, self._stop = [], threading.Event()
        if self._reader is not None:
            self._thread = threading.Thread(target=self._run, name="gpu-counters", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        assert self._reader is not None
        while True:
            try:
                self._readings.append(self._reader.read())
            except (OSError, ValueError, subprocess.SubprocessError) as e:
                self._reason = str(e)
                return
            if self._stop.wait(self._interval_s):
                return

    def stop(self) -> Utilization:
        """Ends reading; the window's means."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._reader is None or not self._readings:
            return Utilization(reason=f"not available: {self._reason or 'no reading'}")
        gpus = [gpu for gpu, _ in self._readings if gpu is not None]
        jpegs = [jpeg for _, jpeg in self._readings if jpeg is not None]
        reason = "" if jpegs else f"JPEG engines: {self._reader.jpeg_reason or 'not read'}"
        return Utilization(statistics.fmean(gpus) if gpus else None, statistics.fmean(jpegs) if jpegs else None,
                           len(self._readings), self._reader.source, reason)


def card_kind(name: str) -> str:
    """The lent kind a card's name is (``H200``, ``H100``), else the name itself."""
    for kind in ("H200", "H100", "B200", "A100"):
        if kind in name:
            return kind
    return name or "no GPU"
