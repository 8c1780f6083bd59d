"""Decode + augment pipelines fed with encoded JPEG bytes and per-sample crop windows,
and a small runner that executes one of them on a list of samples at a requested
batch and image size.

Crop windows and flips come from outside (:mod:`feeder.augment`: a pure function of
seed, epoch and sample key), so a pipeline holds no random state and its identity
(:class:`PipelineSpec`) holds neither the crop ranges nor the image size: one built
pipeline serves any of them, and the batch size varies per run up to the
``max_batch_size`` it was built with.

- CPU: only the window is decoded, by :mod:`shards.jpeg` (libjpeg-turbo cropping
  rows and columns before the IDCT, and on the sharder's JPEGs, which carry restart
  markers, before the entropy decoding too; at a reduced DCT scale where the window
  is at least twice the output), on ``threads`` threads, while
  :class:`feeder.resize.BatchResizer` resizes and mirrors the batch before into one
  batch array. Per window on one core: 0.25 ms (0.32 without restart markers) where
  DALI's ``decoders.image_slice`` takes 0.43. DALI's CPU resize costs
  ~1.2 ms per image where OpenCV takes ~0.12 ms (see :mod:`feeder.resize`). Where
  the window decoder was not built, DALI's ROI decode (``decoders.image_slice``)
  takes its place (``cpu_decoder="dali"``).
- GPU: ``mixed`` ROI decode (nvJPEG) on the stream's device (``device_id``), then
  DALI's resize and flip there; a batch whose destination is on a GPU (a CUDA IPC
  slot) is copied device to device, never through host memory.

Train and validation differ only in the windows (random or central) and the flips.
Usable without gRPC: the in-process baseline in ``bench/`` runs the same code.
"""

from __future__ import annotations

import ctypes
import hashlib
import io
import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Union

import numpy as np
from nvidia.dali import fn, pipeline_def, types
from PIL import Image

from core.errors import ConfigError, DataError, FeederError
from feeder.augment import VAL_CROP_FRACTION, AugmentKind, CropRange, Crops, centre_crops, random_resized_crops
from feeder.config import check_cpu_decoder, cpu_decoder_in_use
from feeder.resize import BatchResizer
from shards import jpeg

if TYPE_CHECKING:
    import torch

__all__ = [
    "AugmentKind",
    "CropRange",
    "Crops",
    "Job",
    "PipelineRunner",
    "PipelineSpec",
    "Repair",
    "SampleDecodeError",
    "VAL_CROP_FRACTION",
    "crop_decode_pipeline",
    "gpu_pipeline",
]

_JPEGS, _ANCHORS, _SHAPES, _SIZES, _FLIPS = "jpegs", "anchors", "shapes", "sizes", "flips"


def _decode_window(jpegs, anchors, shapes, device: str):
    return fn.decoders.image_slice(
        jpegs, anchors, shapes,
        device=device,
        output_type=types.DALIImageType.RGB,
        normalized_anchor=False,
        normalized_shape=False,
        axis_names="WH",  # anchors and shapes are (x, y) and (width, height)
        # Windows are drawn in the stored pixel grid (the index's width/height), as
        # torchvision's PIL path sees it; an EXIF rotation would move them.
        adjust_orientation=False,
    )


def _window_inputs():
    jpegs = fn.external_source(name=_JPEGS, dtype=types.DALIDataType.UINT8, ndim=1)
    anchors = fn.external_source(name=_ANCHORS, dtype=types.DALIDataType.FLOAT, ndim=1)
    shapes = fn.external_source(name=_SHAPES, dtype=types.DALIDataType.FLOAT, ndim=1)
    return jpegs, anchors, shapes


@pipeline_def
def crop_decode_pipeline():
    """CPU: decode each sample's crop window only.

    Inputs (external_source): ``jpegs`` (uint8 bytes), ``anchors`` and ``shapes``
    (float32 ``[x, y]`` and ``[width, height]`` in pixels) per sample.
    Output: uint8 HWC RGB windows of varying sizes.
    """
    return _decode_window(*_window_inputs(), device="cpu")


@pipeline_def
def gpu_pipeline(antialias: bool):
    """GPU: decode each window with nvJPEG, resize to the run's size, mirror.

    Inputs: as :func:`crop_decode_pipeline`, plus ``sizes`` (float32 ``[side]``) and
    ``flips`` (int32 scalar, 1 = mirror) per sample. Output: uint8 HWC, RGB.
    """
    jpegs, anchors, shapes = _window_inputs()
    sizes = fn.external_source(name=_SIZES, dtype=types.DALIDataType.FLOAT, ndim=1)
    flips = fn.external_source(name=_FLIPS, dtype=types.DALIDataType.INT32, ndim=0)
    images = _decode_window(jpegs, anchors, shapes, device="mixed")
    side = sizes[0]
    resized = fn.resize(images, resize_x=side, resize_y=side, antialias=antialias)
    return fn.flip(resized, horizontal=flips, vertical=0)  # type: ignore[arg-type]


@dataclass(frozen=True)
class PipelineSpec:
    """Everything that fixes a built pipeline (the key of a pipeline pool). Crop
    ranges, image size and batch size are per-run inputs, not part of it.

    Args:
        kind: train or val transform (chooses the windows when a run brings none).
        device: ``"cpu"`` or ``"gpu"`` (GPU decodes with the ``mixed`` backend).
        device_id: CUDA device index in this process (GPU only; 0 on the CPU).
        max_batch_size: largest batch one run may carry.
        threads: DALI CPU worker threads, and resize threads on the CPU path.
        prefetch: runs kept in flight (scheduled in DALI before the oldest is
            collected), so decoding the next batch overlaps resizing this one.
        antialias: resize filter: plain bilinear (False, the default: tf.data's
            filter, 1.7x cheaper on the CPU than the antialiased one) or bilinear
            widened when downscaling (True: torchvision's PIL path). On the GPU,
            DALI fixes it when the pipeline is built, hence it is part of the spec.
        cpu_decoder: the CPU path's decoder: ``"libjpeg-turbo"`` (:mod:`shards.jpeg`),
            ``"dali"`` (DALI's ROI decode), or ``"auto"``: the first where it was
            built, else the second.
    """

    kind: AugmentKind
    device: str = "cpu"
    device_id: int = 0
    max_batch_size: int = 256
    threads: int = 2
    prefetch: int = 2
    antialias: bool = False
    cpu_decoder: str = "auto"

    def __post_init__(self) -> None:
        if self.device not in ("cpu", "gpu"):
            raise ConfigError(f"device: {self.device!r} is not cpu or gpu")
        check_cpu_decoder(self.cpu_decoder)
        for name in ("max_batch_size", "threads", "prefetch"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}: must be >= 1, got {getattr(self, name)}")
        if self.device_id < 0 or (self.device == "cpu" and self.device_id != 0):
            raise ConfigError(f"device_id: {self.device_id} is not a CUDA index of a gpu spec")

    @property
    def decoder(self) -> str:
        """What decodes: ``"nvjpeg"`` (GPU), ``"libjpeg-turbo"`` or ``"dali"`` (CPU)."""
        return "nvjpeg" if self.device == "gpu" else cpu_decoder_in_use(self.cpu_decoder)


@dataclass(frozen=True)
class Job:
    """One run's inputs: encoded samples, output side, and (optionally) their windows.

    ``crops`` None: windows are drawn here from the JPEG headers, keyed by the bytes
    (train) or central (val) -- for callers without an index; the daemon passes them.
    ``indices``: the samples' positions in their split, for runners that look samples
    up by them (the decoded cache); the DALI runner ignores them. ``from_copies``:
    bool per sample, its bytes are its half-scale copy (and its window in the copy's
    pixels), for whoever repairs a run that fails.
    """

    jpegs: Sequence[np.ndarray]
    image_size: int
    crops: Crops | None = None
    indices: np.ndarray | None = None
    from_copies: np.ndarray | None = None


JobLike = Union[Job, tuple[Sequence[np.ndarray], int]]


class SampleDecodeError(DataError):
    """A run failed because of some of its samples.

    Attributes:
        positions: the failing samples' positions in the run (as DALI names them),
            or None where DALI's message names none.
    """

    def __init__(self, message: str, positions: tuple[int, ...] | None = None) -> None:
        super().__init__(message)
        self.positions = positions


Repair = Callable[[Job, SampleDecodeError], Job]
"""Given a job that failed and its error (``positions`` always set), the job to run
instead (the failing samples replaced), or raises to end the run."""


@dataclass(frozen=True)
class _InFlight:
    job: Job  # with ``crops`` set to the windows drawn, so a retry decodes the same
    crops: Crops
    windows: jpeg.BatchDecode | None = None  # libjpeg-turbo path: the windows being decoded


def _build(spec: PipelineSpec, seed: int):
    common = dict(
        batch_size=spec.max_batch_size,
        num_threads=spec.threads,
        device_id=spec.device_id if spec.device == "gpu" else None,
        # Depth 1: DALI's own first-run prefetch would demand ``depth`` fed batches
        # up front; the runner schedules up to ``spec.prefetch`` runs itself instead.
        prefetch_queue_depth=1,
        exec_dynamic=True,
        seed=seed,
    )
    if spec.device == "gpu":
        pipe = gpu_pipeline(antialias=spec.antialias, **common)
    elif spec.decoder == "libjpeg-turbo":
        return None
    else:
        pipe = crop_decode_pipeline(**common)
    pipe.build()
    return pipe


def _header_crops(kind: AugmentKind, jpegs: Sequence[np.ndarray], seed: int) -> Crops:
    """Windows for samples that came without any: sizes from the JPEG headers, the
    random ones keyed by a hash of each sample's bytes."""
    sizes = np.array([_jpeg_size(j) for j in jpegs], dtype=np.int64).reshape(-1, 2)
    if kind is AugmentKind.VAL:
        return centre_crops(sizes[:, 0], sizes[:, 1])
    digests = b"".join(hashlib.blake2b(j.tobytes(), digest_size=8).digest() for j in jpegs)
    hashes = np.frombuffer(digests, dtype="<u8").astype(np.uint64)
    return random_resized_crops(seed, 0, hashes, sizes[:, 0], sizes[:, 1], CropRange())


def _jpeg_size(data: np.ndarray) -> tuple[int, int]:
    try:
        with Image.open(io.BytesIO(data.tobytes())) as image:
            return image.size
    except Exception:  # noqa: BLE001 - PIL raises many types; DALI names the failure
        return (1, 1)


_SAMPLE_NUMBER = re.compile(r"sample #(\d+)")


def _failing_positions(error: Exception, batch_size: int) -> tuple[int, ...] | None:
    found = {int(n) for n in _SAMPLE_NUMBER.findall(str(error))}
    return tuple(sorted(found)) if found and max(found) < batch_size else None


def _dali_reason(error: Exception) -> str:
    # DALI wraps the operator's message in a traceback; keep the line that says why.
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if "encountered:" in lines:
        return lines[lines.index("encountered:") + 1]
    return lines[0] if lines else type(error).__name__


# Where a batch lands: a host array, or a torch tensor (host, or on a GPU: a CUDA IPC
# slot, written device to device).
Output = Union[np.ndarray, "torch.Tensor"]
# Supplies the array or tensor a batch of the given shape is written into.
Allocate = Callable[[tuple[int, ...]], Output]


def _copy_on_device(out, dst: torch.Tensor) -> None:  # type: ignore[no-untyped-def]
    """DALI's GPU output (a TensorListGPU of equal-shaped samples) into ``dst``, a
    contiguous uint8 CUDA tensor, device to device, on ``dst``'s device's current
    stream (the CUDA IPC sender records the slot's event there).

    ``outputs()`` returned the run finished (synchronised with the host). The copy
    waits for its own end: DALI takes the source buffer back at the next
    ``outputs()`` and may reuse it on its own streams, which are not ordered after
    ours; a batch's copy takes tens of microseconds, its decoding milliseconds."""
    import torch

    shapes = [list(s) for s in out.shape()]
    if not dst.is_contiguous() or shapes != [list(dst.shape[1:])] * int(dst.shape[0]):
        raise FeederError(f"device output of {len(shapes)} samples does not fit {list(dst.shape)}")
    with torch.cuda.device(dst.device):
        stream = torch.cuda.current_stream(dst.device).cuda_stream
        out.copy_to_external(ctypes.c_void_p(dst.data_ptr()), ctypes.c_void_p(stream), non_blocking=False)


class PipelineRunner:
    """One built pipeline, run on lists of encoded JPEGs. Not thread-safe: one
    stream (or one benchmark loop) owns a runner at a time.

    Args:
        spec: what to build.
        seed: seed of the windows drawn for runs that bring none (DALI itself draws
            nothing).
    """

    # Decodes windows only: a job may bring a half-scale copy (shards.reader.SplitIndex.read_windows).
    decodes_half_copies = True

    def __init__(self, spec: PipelineSpec, seed: int = 0) -> None:
        self.spec = spec
        self._seed = seed
        self._pipe = _build(spec, seed)
        self.decoder = spec.decoder
        # Buffers of the batches in flight and of the one being resized.
        self._windows = (jpeg.WindowDecoder(spec.threads, arenas=spec.prefetch + 1)
                         if self.decoder == "libjpeg-turbo" else None)
        self._resizer = BatchResizer(spec.threads) if spec.device == "cpu" else None
        self._pending: deque[_InFlight] = deque()  # runs scheduled in DALI, oldest first
        # GPU outputs written to a device destination / copied through host memory.
        self.device_copies = self.host_copies = 0

    def run(self, jpegs: Sequence[np.ndarray], image_size: int, crops: Crops | None = None) -> np.ndarray:
        """Decode and augment one batch.

        Args:
            jpegs: encoded JPEG bytes, one uint8 array per sample (1..max_batch_size).
            image_size: output side in pixels.
            crops: each sample's window (original pixels) and flip; None draws them
                (see :class:`Job`).

        Returns:
            uint8 array ``[len(jpegs), image_size, image_size, 3]``.

        Raises:
            SampleDecodeError: a sample could not be decoded (a :class:`DataError`).
        """
        out = next(self.run_many([Job(jpegs, image_size, crops)]))
        if not isinstance(out, np.ndarray):  # without ``allocate`` outputs are host arrays
            raise TypeError(f"run() made a {type(out).__name__}, not a host array")
        return out

    def run_many(
        self, batches: Iterable[JobLike], repair: Repair | None = None, allocate: Allocate | None = None
    ) -> Iterator[Output]:
        """Run a sequence of jobs (or ``(jpegs, image_size)`` pairs) keeping up to
        ``prefetch`` of them in flight, yielding outputs in order (same contract as
        :meth:`run` per batch).

        Args:
            batches: the jobs.
            repair: what to do when a job fails to decode: None raises the
                :class:`SampleDecodeError`; else the runs behind it finish, the
                failing samples are found (DALI names the first; each sample of the
                job runs alone where it does not), ``repair`` replaces them and the
                repaired job runs alone, again until it succeeds or ``repair`` raises.
                The runner stays usable either way.
            allocate: supplies the array (or torch tensor) each yielded output is
                written into (e.g. a transport's slot, so the pixels are written
                where they leave), and is what is yielded; called only for outputs
                that are yielded. On the GPU a CUDA tensor is written device to
                device; a host destination costs a copy to host memory
                (``host_copies``).
        """
        pending = iter(batches)
        exhausted = False
        while True:
            while not exhausted and len(self._pending) < self.spec.prefetch:
                item = next(pending, None)
                if item is None:
                    exhausted = True
                    break
                self._submit(item if isinstance(item, Job) else Job(*item))
            if not self._pending:
                return
            head = self._pending[0]
            outcome = self._outcome(allocate)
            if not isinstance(outcome, SampleDecodeError):
                yield outcome
                continue
            if repair is None:
                raise outcome
            # Finish the runs behind the failed one first: the retry then runs alone
            # and its output still comes out before theirs.
            behind = [(self._pending[0], self._outcome(allocate)) for _ in range(len(self._pending))]
            yield self._retry(head, outcome, repair, allocate)
            for flight, result in behind:
                yield self._retry(flight, result, repair, allocate) if isinstance(result, SampleDecodeError) else result

    def _outcome(self, allocate: Allocate | None = None) -> Output | SampleDecodeError:
        try:
            return self._collect(allocate=allocate)
        except SampleDecodeError as e:
            return e

    def _retry(
        self, flight: _InFlight, error: SampleDecodeError, repair: Repair, allocate: Allocate | None = None
    ) -> Output:
        """Repair a failed run and run it alone until it decodes (nothing else is in
        flight meanwhile)."""
        for _ in range(len(flight.job.jpegs) + 1):  # each round replaces at least one sample
            if error.positions is None:
                error = SampleDecodeError(str(error), self._locate(flight, error))
            flight = self._submit(repair(flight.job, error))
            outcome = self._outcome(allocate)
            if not isinstance(outcome, SampleDecodeError):
                return outcome
            error = outcome
        raise error

    def _locate(self, flight: _InFlight, error: SampleDecodeError) -> tuple[int, ...]:
        """Positions of the samples of a failed run that fail when run alone (DALI did
        not say which). Raises ``error`` when each decodes alone: the run failed for
        another reason than its samples, and none of them is to be blamed."""
        job, crops = flight.job, flight.crops
        failing = []
        for i in range(len(job.jpegs)):
            one = Crops(boxes=crops.boxes[i : i + 1], flips=crops.flips[i : i + 1])
            self._submit(Job([job.jpegs[i]], job.image_size, one))
            if isinstance(self._outcome(), SampleDecodeError):
                failing.append(i)
        if not failing:
            raise error
        return tuple(failing)

    def _submit(self, job: Job) -> _InFlight:
        n = len(job.jpegs)
        if not 1 <= n <= self.spec.max_batch_size:
            raise ConfigError(f"batch of {n} outside 1..{self.spec.max_batch_size}")
        crops = job.crops if job.crops is not None else _header_crops(self.spec.kind, job.jpegs, self._seed)
        if len(crops) != n:
            raise ConfigError(f"crops: {len(crops)} windows for {n} samples")
        if self._windows is not None:
            boxes = crops.boxes
            scales = np.array([jpeg.dct_denominator(int(w), int(h), job.image_size) for w, h in boxes[:, 2:]])
            decoding = self._windows.submit(job.jpegs, boxes, scales)
            self._pending.append(_InFlight(replace(job, crops=crops), crops, decoding))
            return self._pending[-1]
        boxes = crops.boxes.astype(np.float32)
        self._pipe.feed_input(_JPEGS, list(job.jpegs))
        self._pipe.feed_input(_ANCHORS, list(boxes[:, :2]))
        self._pipe.feed_input(_SHAPES, list(boxes[:, 2:]))
        if self.spec.device == "gpu":
            self._pipe.feed_input(_SIZES, [np.array([job.image_size], dtype=np.float32)] * n)
            self._pipe.feed_input(_FLIPS, list(crops.flips.astype(np.int32)))
        self._pipe.schedule_run()
        self._pending.append(_InFlight(replace(job, crops=crops), crops))
        return self._pending[-1]

    def _collect(self, resize: bool = True, allocate: Allocate | None = None) -> Output:
        flight = self._pending.popleft()
        job, size, flips = flight.job, flight.job.image_size, flight.crops.flips
        if flight.windows is not None:
            out, failed = flight.windows.result()
            if failed:
                first = next(iter(failed))
                more = f" (and {len(failed) - 1} more)" if len(failed) > 1 else ""
                raise SampleDecodeError(f"decode failed: sample #{first}: {failed[first]}{more}", tuple(failed))
        else:
            try:
                (out,) = self._pipe.outputs()
            except RuntimeError as e:
                positions = _failing_positions(e, len(job.jpegs))
                raise SampleDecodeError(f"decode failed: {_dali_reason(e)}", positions) from e
        if not resize:  # drained: nobody wants the pixels
            return np.empty((0, size, size, 3), dtype=np.uint8)
        shape = (len(out), size, size, 3)
        dst = allocate(shape) if allocate is not None else np.empty(shape, dtype=np.uint8)
        if self._resizer is None:  # GPU: DALI resized on the device
            return self._from_device(out, dst)
        host = dst if isinstance(dst, np.ndarray) else dst.numpy()  # a torch destination is a host one here
        windows = out if isinstance(out, list) else [np.asarray(out[i]) for i in range(len(out))]
        self._resizer.resize(windows, size, flips, self.spec.antialias, out=host)
        return dst

    def _from_device(self, out, dst: Output) -> Output:  # type: ignore[no-untyped-def]
        """Copies a GPU run's output into ``dst``: device to device for a CUDA
        tensor, else once through host memory (counted in ``host_copies``)."""
        if not isinstance(dst, np.ndarray) and dst.device.type == "cuda":
            _copy_on_device(out, dst)
            self.device_copies += 1
            return dst
        np.copyto(dst if isinstance(dst, np.ndarray) else dst.numpy(), out.as_cpu().as_array())
        self.host_copies += 1
        return dst

    def drain(self) -> None:
        """Collect and drop every run still in flight (a stream stopped early)."""
        while self._pending:
            try:
                self._collect(resize=False)
            except DataError:
                continue

    def close(self) -> None:
        """Release the resize threads and the DALI pipeline's threads and buffers now,
        not whenever the runner is collected. The runner cannot run after this."""
        if self._resizer is not None:
            self._resizer.close()
        if self._windows is not None:
            self._windows.close()
        shutdown = getattr(self._pipe, "_shutdown", None)  # what Pipeline.__del__ calls
        if shutdown is not None:
            shutdown()
