"""A stream's runner in front of the decoded cache (:mod:`decode.decoded_cache`).

Per batch, each sample is looked up by its key (the daemon's: dataset, split and
sample index, a mixed stream's by its own dataset's, so plain and mixed streams of a
dataset share entries):

- **hit**: its crop window, drawn in original pixels, is mapped into the cached
  image, and the CPU finishing stage (:class:`decode.finish.Finisher`: the C resize of
  ``decode/_resize.c``, OpenCV's where it was not built) finishes it into the batch on
  the workers, the GIL released: no JPEG, no DALI.
- **miss while the cache admits**: the whole image is decoded (a crop window would not
  serve the next epoch's crop), downscaled, admitted, then served like a hit, so a
  sample's pixels are the same on its first pass as on later ones.
- **miss once the cache is full**, or an image that did not decode: the stream's own
  runner (:class:`decode.runner.PipelineRunner`, its decoder chosen as without a cache:
  :mod:`decode.registry`) decodes its window from JPEG; a sample that fails to decode
  is never cached.
- **bypass**: a batch whose image size exceeds the cache's side would upscale cached
  pixels, so it is decoded from JPEG as without a cache, and counted.

Hits, misses and bypassed samples, entries and bytes are counted (by the daemon's
metrics).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Generator, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np

from core.errors import ConfigError
from decode.decoded_cache import CacheCounters, DecodedCache, SampleSizes, cached_windows, decode_downscaled
from decode.finish import Finisher, Finishing
from decode.jobs import Allocate, Decoded, Failed, Job, JobT, Outcome, SampleDecodeError
from decode.runner import PipelineRunner
from transport.base import Slot, host_slot

__all__ = ["CachedRunner"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")

# All-cached jobs whose resizes are started before the outcome of the one before is
# handed out. With one, the workers ran out of work whenever the stream's thread took
# longer to read and hand on a batch than they took to resize one (later epochs at
# 224 px, 2 cores: 9,284-11,095 images/s with one ahead, 11,756-12,826 with two, no
# more with three). Each holds a ring slot: a stream's ring needs more slots than this
# and what its client keeps, or a batch waits for one (then goes inline).
_RESIZED_AHEAD = 2


def _written(slot: Slot, fill: Callable[[np.ndarray], object]) -> Slot:
    """``slot`` filled by ``fill`` (which writes a host array): directly when the slot
    is in host memory, else through a host array copied to the device (cache hits are
    resized on the CPU)."""
    if not slot.on_gpu:
        fill(slot.array)
        return slot
    import torch

    host = np.empty(slot.shape, dtype=np.uint8)
    fill(host)
    # On the slot's stream, which waits for the client's last read of the slot; the
    # copy from pageable memory has read ``host`` when it returns.
    with torch.cuda.stream(slot.stream) if slot.stream is not None else contextlib.nullcontext():
        slot.tensor.copy_(torch.from_numpy(host))
    slot.seal()
    return slot


@dataclass(frozen=True)
class _Begun(Generic[JobT]):
    """A job :meth:`CachedRunner.run_many` has taken: ``finish`` hands out its
    outcome (running it first where nothing was started); ``settle``, where its
    resizes were started, waits for them without handing anything out."""

    finish: Callable[[], Outcome[JobT]]
    settle: Callable[[], object] | None = None


class CachedRunner:
    """Serves a stream's jobs from the decoded cache, its own runner doing the rest.

    Same use as :class:`decode.runner.PipelineRunner` (``run_many``, ``run_alone``);
    jobs must carry sample indices. Its work runs on the inner runner's lane.

    Args:
        inner: the stream's pipeline (for misses once the cache is full); the caller
            keeps ownership (returns it to its pool).
        cache: the daemon's cache.
        split: the original sizes of the samples the job's indices refer to.
        key: a sample's cache key by its index (the daemon's: dataset, split and
            index of the dataset the sample is of, so streams of a dataset share
            entries).
        metrics: where hits, misses and bypassed samples are counted.
    """

    # Caches whole images, windows mapped in their own pixels: jobs bring the images.
    decodes_half_copies = False

    def __init__(
        self, inner: PipelineRunner, cache: DecodedCache, split: SampleSizes, key: Callable[[int], Hashable],
        metrics: CacheCounters,
    ) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._cache = cache
        self._key = key
        self._split = split
        self._metrics = metrics
        self.lane = inner.lane  # the stream's share of the daemon's workers
        self._finisher = Finisher(self.lane, self.spec.antialias)

    @property
    def prefetch(self) -> int:
        """The inner runner's runs in flight (its misses run one job at a time)."""
        return self.inner.prefetch

    @prefetch.setter
    def prefetch(self, runs: int) -> None:
        self.inner.prefetch = runs

    def held(self, indices: np.ndarray, image_size: int) -> np.ndarray | None:
        """The samples at ``indices`` the cache holds, for a batch of ``image_size``
        (None where it is bypassed): their bytes are not needed. The cache never
        evicts, so what it holds now it holds when the batch runs."""
        if image_size > self._cache.side:
            return None
        return np.fromiter((self._cache.get(self._key(int(i))) is not None for i in indices), bool,
                           count=len(indices))

    def run_many(self, jobs: Iterable[JobT], allocate: Allocate = host_slot) -> Generator[Outcome[JobT], None, None]:
        """One outcome per job, in order (as :meth:`PipelineRunner.run_many`). A job
        whose samples are all cached is started up to ``_RESIZED_AHEAD`` jobs before
        its outcome is handed out: its resizes run on the workers while the jobs before
        it are handed on and the next are read. Others run when their turn comes.

        Closed early, it waits for the resizes it started (they write into slots
        the consumer had) and starts nothing: a job not begun stays not run."""
        ahead: deque[_Begun[JobT]] = deque()
        try:
            for job in jobs:
                ahead.append(self._begin(job, allocate))
                if len(ahead) > _RESIZED_AHEAD:
                    yield ahead.popleft().finish()
            while ahead:
                yield ahead.popleft().finish()
        finally:  # a consumer gone: nothing may still write into the slots it had
            for begun in ahead:
                if begun.settle is not None:
                    with contextlib.suppress(Exception):
                        begun.settle()

    def _begin(self, job: JobT, allocate: Allocate) -> _Begun[JobT]:
        """What hands out ``job``'s outcome: its resizes already started where every
        sample is cached and the output is in host memory, else all of it later."""
        if job.indices is None or job.image_size > self._cache.side:
            return _Begun(lambda: self.run_alone(job, allocate))
        keys: list[Hashable] = [self._key(int(i)) for i in job.indices]
        images = [self._cache.get(key) for key in keys]
        if any(image is None for image in images):
            return _Begun(lambda: self.run_alone(job, allocate))
        slot = allocate((len(job), job.image_size, job.image_size, 3))
        if slot.on_gpu:
            return _Begun(lambda: Decoded(job, _written(slot, lambda out: self._from_cached(
                job, images, list(range(len(job))), out))))
        _, finishing = self._start_cached(job, images, list(range(len(job))), slot.array)
        self._metrics.decoded_cache(hits=len(job), usage=self._cache.usage())

        def finish() -> Outcome[JobT]:
            finishing.wait()
            return Decoded(job, slot)

        return _Begun(finish, settle=finishing.wait)

    def run_alone(self, job: JobT, allocate: Allocate = host_slot) -> Outcome[JobT]:
        """The outcome of ``job``: cached samples resized from the cache, the others
        decoded (and admitted while the cache admits), a sample that does not decode
        named in a :class:`Failed`.

        Raises:
            ConfigError: a job without indices.
        """
        if job.indices is None:
            raise ConfigError("decoded cache: every job needs its sample indices")
        if job.image_size > self._cache.side:
            self._metrics.decoded_cache(bypassed=len(job), usage=self._cache.usage())
            return self.inner.run_alone(job, allocate)
        keys: list[Hashable] = [self._key(int(i)) for i in job.indices]
        images = [self._cache.get(key) for key in keys]
        missing = [k for k, image in enumerate(images) if image is None]
        if any(len(job.jpegs[k]) == 0 for k in missing):  # held when read: the cache never evicts
            raise ConfigError("decoded cache: a sample read as held is not in it")
        hits = len(images) - len(missing)
        if missing and self._cache.admitting:
            self._fill(job, keys, images, missing)
            missing = [k for k in missing if images[k] is None]
        self._metrics.decoded_cache(hits=hits, misses=len(images) - hits, usage=self._cache.usage())
        return self._assemble(job, images, missing, allocate)

    def _fill(self, job: Job, keys: list[Hashable], images: list[np.ndarray | None], missing: list[int]) -> None:
        """Decode the missing samples whole, downscaled; admit those that decode."""
        rows = np.asarray(job.indices)[missing]
        shorter = np.minimum(self._split.widths[rows], self._split.heights[rows])
        side = self._cache.side
        decoded = self._parallel(
            lambda k_s: decode_downscaled(job.jpegs[k_s[0]], side, int(k_s[1])), list(zip(missing, shorter))
        )
        for k, image in zip(missing, decoded):
            if image is not None:  # an image that does not decode is left to DALI, never cached
                images[k] = image
                self._cache.admit(keys[k], image)

    def _assemble(
        self, job: JobT, images: list[np.ndarray | None], missing: list[int], allocate: Allocate
    ) -> Outcome[JobT]:
        size = job.image_size
        shape = (len(images), size, size, 3)
        ready = [k for k, image in enumerate(images) if image is not None]
        if not missing:  # every sample cached: resized straight into the output
            return Decoded(job, _written(allocate(shape), lambda out: self._from_cached(job, images, ready, out)))
        decoded = self.inner.run_alone(job.only(missing))  # first: it may fail
        if isinstance(decoded, Failed):
            failures = {missing[p]: reason for p, reason in (decoded.error.failures or {}).items()}
            return Failed(job, SampleDecodeError(decoded.error.detail, failures))
        out = np.empty(shape, dtype=np.uint8)
        if ready:
            out[ready] = self._from_cached(job, images, ready)
        out[missing] = decoded.slot.array
        return Decoded(job, _written(allocate(shape), lambda dst: np.copyto(dst, out)))

    def _from_cached(
        self, job: Job, images: Sequence[np.ndarray | None], ready: list[int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """Crop and finish cached images ``ready`` (positions in the job)."""
        out, finishing = self._start_cached(job, images, ready, out, first=True)
        finishing.wait()
        return out

    def _start_cached(
        self, job: Job, images: Sequence[np.ndarray | None], ready: list[int], out: np.ndarray | None = None,
        first: bool = False,
    ) -> tuple[np.ndarray, Finishing]:
        """Start :meth:`_from_cached` on the lane: ``out`` and the finishing that fills it."""
        crops = job.crops
        chosen = [images[k] for k in ready]
        cached = [image for image in chosen if image is not None]
        rows = np.asarray(job.indices)[ready]
        shapes = np.array([image.shape[:2] for image in cached], dtype=np.int64).reshape(-1, 2)
        windows = cached_windows(crops.boxes[ready], self._split.widths[rows], self._split.heights[rows], shapes)
        views = [image[y0:y1, x0:x1] for image, (x0, y0, x1, y1) in zip(cached, windows)]
        return self._finisher.start(views, job.image_size, crops.rows(ready), out=out, first=first)

    def _parallel(self, work: Callable[[_Item], _Result], items: list[_Item]) -> list[_Result]:
        """``[work(x) for x in items]`` on the stream's lane (the decoder releases the GIL)."""
        results: list[_Result | None] = [None] * len(items)

        def one(i: int) -> None:
            results[i] = work(items[i])

        self.lane.run(one, len(items))
        return results  # type: ignore[return-value]

    @property
    def device_copies(self) -> int:
        return self.inner.device_copies

    @property
    def host_copies(self) -> int:
        return self.inner.host_copies

    @property
    def decoded_early(self) -> int:
        return self.inner.decoded_early
