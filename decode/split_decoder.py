"""A GPU pipeline's batches split between the node's CPUs and the GPU.

On a GPU node the training step owns the SMs. DALI's ``mixed`` decode gives part of
each batch to the GPU's hardware JPEG engines, but the rest of its decoding, and all
of its resizing, runs on the SMs beside the step. :class:`SplitDecoder` takes the
first rows of each batch off the GPU altogether: the window decoder decodes and
resizes them on the daemon's CPU workers, and they are uploaded into the batch's
slot (a copy engine's work, no SM time); DALI decodes the rest on the GPU.

How many rows go to the CPU is tuned per batch from what the decoder sees
(:class:`CpuShare`): after each run it asks whether the CPU's part was late, that
is, still being decoded once the GPU's part was done. Late, the CPU's share shrinks;
on time, it grows. When the consumer is the slow side (the training step), the runs
wait for it and the CPU's part is never late, so the share climbs until the CPU
cannot keep up with the step: as much of the work as the node's cores can carry goes
to them, and only the rest costs the GPU anything. When the daemon is the slow side,
the share settles where both parts take as long, the fastest the two can go
together. A share given by hand (``--cpu-decode-share``) is kept as is.

The two parts decode with different libraries (libjpeg-turbo and the C resize;
nvJPEG and DALI's resize), so a sample's pixels may differ by rounding with the part
its batch row fell in, as they already do between DALI's hardware and CUDA decoders.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from decode.jobs import Allocate, Job, SampleDecodeError
from transport.base import Slot

__all__ = ["CpuShare", "PartDecoder", "SplitDecoder"]

# The CPU's part counts as late when the decoder waited for it this long after the
# GPU's part was done (a fraction of a run's time; below it is scheduling noise).
LATE_S = 0.0005
# How much the share moves after one run: from all on the GPU to half on the CPU in
# 32 runs (a second or two at training rates).
STEP = 1 / 64


class CpuShare:
    """The share of each batch decoded on the CPU.

    Args:
        fixed: a share to keep (0..1), or None to tune it (starting with all of it
            on the GPU, where the decoder was before).
    """

    def __init__(self, fixed: float | None) -> None:
        self.fixed = fixed
        self.value = 0.0 if fixed is None else fixed
        self.late = self.on_time = 0  # runs whose CPU part was late, or on time

    def rows(self, batch: int) -> int:
        """Rows of a batch of ``batch`` samples the CPU decodes (its first ones)."""
        return min(batch, round(self.value * batch))

    def observe(self, cpu_rows: int, cpu_late_s: float) -> None:
        """A run's CPU part (``cpu_rows`` rows) came ``cpu_late_s`` after its GPU part."""
        late = cpu_rows > 0 and cpu_late_s > LATE_S
        self.late += late
        self.on_time += not late
        if self.fixed is None:
            self.value = min(1.0, max(0.0, self.value + (-STEP if late else STEP)))


class PartDecoder(Protocol):
    """A decoder a batch's part goes to: :class:`decode.decoder.PhasedDecoder`'s
    phases."""

    def start(self, job: Job) -> Any: ...

    def collect(self, started: Any) -> Any: ...

    def write(self, collected: Any, slot: Slot) -> None: ...

    def discard(self, collected: Any) -> None: ...

    def release_buffers(self) -> None: ...

    def close(self) -> None: ...


# A started run: its job, its CPU rows, and each part's started run (None: no rows).
_Started = tuple[Job, int, Any, Any]
_Collected = tuple[Job, int, Any, Any]


class SplitDecoder:
    """The first :meth:`CpuShare.rows` rows of each batch on ``cpu`` (the window
    decoder), the rest on ``gpu`` (DALI's GPU decoder); both write into the one slot.
    Any two decoders that write host slots split a batch the same way."""

    can_look_ahead = looks_ahead = False  # a split run decodes its batch as two
    decoded_early = 0

    def __init__(self, cpu: PartDecoder, gpu: PartDecoder, share: CpuShare) -> None:
        self._cpu, self._gpu, self.share = cpu, gpu, share
        self.cpu_samples = self.gpu_samples = 0

    @property
    def device_copies(self) -> int:
        return int(getattr(self._gpu, "device_copies", 0))

    @property
    def host_copies(self) -> int:
        return int(getattr(self._gpu, "host_copies", 0))

    def ahead(self, job: Job) -> None:
        pass

    def start(self, job: Job) -> _Started:
        rows = self.share.rows(len(job))
        cpu = self._cpu.start(job.only(range(rows))) if rows else None
        gpu = self._gpu.start(job.only(range(rows, len(job)))) if rows < len(job) else None
        return job, rows, cpu, gpu

    def collect(self, started: _Started) -> _Collected:
        """Both parts, the GPU's first; a failure of either names its samples'
        positions in the whole batch (the other part is given up)."""
        job, rows, cpu, gpu = started
        failures: dict[int, str] = {}
        detail = ""
        gpu_done = cpu_done = None
        if gpu is not None:
            try:
                gpu_done = self._gpu.collect(gpu)
            except SampleDecodeError as e:
                detail = e.detail
                failures.update({rows + p: why for p, why in (e.failures or {}).items()})
        waited = time.perf_counter()
        if cpu is not None:
            try:
                cpu_done = self._cpu.collect(cpu)
            except SampleDecodeError as e:
                detail = detail or e.detail
                failures.update(e.failures or {})
        self.share.observe(rows, time.perf_counter() - waited)
        if detail or failures:
            if cpu_done is not None:
                self._cpu.discard(cpu_done)
            raise SampleDecodeError(detail, failures or None)
        return job, rows, cpu_done, gpu_done

    def finish(self, started: _Started, allocate: Allocate | None) -> Slot | None:
        job, rows, cpu_done, gpu_done = self.collect(started)
        if allocate is None:
            if cpu_done is not None:
                self._cpu.discard(cpu_done)
            return None
        try:
            slot = allocate((len(job), job.image_size, job.image_size, 3))
        except BaseException:
            if cpu_done is not None:
                self._cpu.discard(cpu_done)
            raise
        if gpu_done is not None:
            self._gpu.write(gpu_done, _rows(slot, rows, len(job)))
        if cpu_done is not None:
            self._cpu.write(cpu_done, _rows(slot, 0, rows))
        self.cpu_samples += rows
        self.gpu_samples += len(job) - rows
        return slot

    def release_buffers(self) -> None:
        self._cpu.release_buffers()
        self._gpu.release_buffers()

    def close(self) -> None:
        self._cpu.close()
        self._gpu.close()


def _rows(slot: Slot, first: int, end: int) -> Slot:
    """Rows ``first:end`` of ``slot`` as a slot of their own (written on its stream)."""
    return Slot(pixels=slot.pixels[first:end], index=slot.index, generation=slot.generation, stream=slot.stream)
