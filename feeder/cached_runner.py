"""A stream's runner in front of the decoded cache (:mod:`feeder.decoded_cache`).

Per batch, each sample is looked up by (dataset, split, sample index):

- **hit**: its crop window, drawn in original pixels, is mapped into the cached
  image and OpenCV crops, resizes and mirrors it into the batch
  (:class:`feeder.resize.BatchResizer`): no JPEG, no DALI.
- **miss while the cache admits**: the whole image is decoded (a crop window would not
  serve the next epoch's crop), downscaled, admitted, then served like a hit, so a
  sample's pixels are the same on its first pass as on later ones.
- **miss once the cache is full**, or an image that did not decode: the stream's own
  DALI runner ROI-decodes it from JPEG as without a cache; a sample that fails to
  decode is never cached.
- **bypass**: a batch whose image size exceeds the cache's side would upscale cached
  pixels, so it is decoded from JPEG as without a cache, and counted.

Hits, misses and bypassed samples, entries and bytes go to the daemon's metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np

from core.errors import ConfigError
from feeder.augment import Crops
from feeder.decoded_cache import DecodedCache, cached_windows, decode_downscaled
from feeder.metrics import ServerMetrics
from feeder.pipeline import Allocate, Job, Output, PipelineRunner, Repair, SampleDecodeError
from feeder.resize import BatchResizer
from shards.reader import SplitIndex

__all__ = ["CachedRunner"]

_Item = TypeVar("_Item")
_Result = TypeVar("_Result")


def _written(dst: Output, fill: Callable[[np.ndarray], object]) -> Output:
    """``dst`` filled by ``fill`` (which writes a host array): directly when ``dst`` is
    in host memory, else through a host array copied to the device (cache hits are
    resized on the CPU)."""
    if isinstance(dst, np.ndarray):
        fill(dst)
        return dst
    import torch

    host = np.empty(tuple(dst.shape), dtype=np.uint8)
    fill(host)
    dst.copy_(torch.from_numpy(host))
    return dst


class CachedRunner:
    """Serves a stream's jobs from the decoded cache, its own runner doing the rest.

    Same use as :class:`feeder.pipeline.PipelineRunner` (``run_many``, ``drain``,
    ``close``); jobs must carry sample indices and crop windows.

    Args:
        inner: the stream's pipeline (for misses once the cache is full); the caller
            keeps ownership (returns it to its pool).
        cache: the daemon's cache.
        dataset: the dataset's name, part of each sample's key.
        split: the split the job's indices refer to (original sizes).
        metrics: daemon counters.
    """

    # Caches whole images, windows mapped in their own pixels: jobs bring the images.
    decodes_half_copies = False

    def __init__(
        self, inner: PipelineRunner, cache: DecodedCache, dataset: str, split: SplitIndex, metrics: ServerMetrics
    ) -> None:
        self.inner = inner
        self.spec = inner.spec
        self._cache = cache
        self._prefix = (dataset, split.split)
        self._split = split
        self._metrics = metrics
        self._resizer = BatchResizer(self.spec.threads)
        self._pool = ThreadPoolExecutor(self.spec.threads, thread_name_prefix="feeder-cache-fill")

    def run_many(
        self, batches: Iterable[Job], repair: Repair | None = None, allocate: Allocate | None = None
    ) -> Iterator[Output]:
        """One uint8 ``[n, size, size, 3]`` batch per job, in order; ``repair`` and
        ``allocate`` as for :meth:`PipelineRunner.run_many`.

        Raises:
            ConfigError: a job without indices or crops.
            SampleDecodeError: a sample the cache could not take failed to decode in
                DALI too (and ``repair`` is None).
        """
        for job in batches:
            yield self._run_repaired(job, repair, allocate)

    def _run_repaired(self, job: Job, repair: Repair | None, allocate: Allocate | None) -> Output:
        for _ in range(len(job.jpegs) + 1):  # each round replaces at least one sample
            try:
                return self._run(job, allocate)
            except SampleDecodeError as e:
                if repair is None or not e.positions:
                    raise
                job = repair(job, e)
        raise ConfigError("decoded cache: a batch still failed after every sample was replaced")

    def _run(self, job: Job, allocate: Allocate | None = None) -> Output:
        if job.indices is None or job.crops is None:
            raise ConfigError("decoded cache: every job needs its sample indices and crop windows")
        if job.image_size > self._cache.side:
            self._metrics.decoded_cache(bypassed=len(job.jpegs), usage=self._cache.usage())
            return next(self.inner.run_many([job], allocate=allocate))
        keys: list[Hashable] = [(*self._prefix, int(i)) for i in job.indices]
        images = [self._cache.get(key) for key in keys]
        missing = [k for k, image in enumerate(images) if image is None]
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
        self, job: Job, images: list[np.ndarray | None], missing: list[int], allocate: Allocate | None
    ) -> Output:
        crops = job.crops
        if crops is None:  # checked in _run; narrows the type
            raise ConfigError("decoded cache: a job without crop windows")
        size = job.image_size
        shape = (len(images), size, size, 3)
        ready = [k for k, image in enumerate(images) if image is not None]
        if not missing:  # every sample cached: resized straight into the output
            if allocate is None:
                return self._from_cached(job, images, ready)
            return _written(allocate(shape), lambda out: self._from_cached(job, images, ready, out))
        decoded = self._decode_missing(job, crops, missing)  # first: it may fail
        out = np.empty(shape, dtype=np.uint8)
        if ready:
            out[ready] = self._from_cached(job, images, ready)
        out[missing] = decoded
        return out if allocate is None else _written(allocate(shape), lambda dst: np.copyto(dst, out))

    def _decode_missing(self, job: Job, crops: Crops, missing: list[int]) -> np.ndarray:
        """The samples the cache does not hold, through the stream's DALI runner; a
        failure names positions in ``job``."""
        subset = Crops(boxes=crops.boxes[missing], flips=crops.flips[missing])
        try:
            return self.inner.run([job.jpegs[k] for k in missing], job.image_size, subset)
        except SampleDecodeError as e:
            if e.positions is None:  # DALI did not say which: find them one by one
                positions = tuple(k for k in missing if not self._decodes_alone(job, crops, k))
            else:
                positions = tuple(missing[p] for p in e.positions)
            raise SampleDecodeError(str(e), positions or None) from e

    def _decodes_alone(self, job: Job, crops: Crops, k: int) -> bool:
        one = Crops(boxes=crops.boxes[k : k + 1], flips=crops.flips[k : k + 1])
        try:
            self.inner.run([job.jpegs[k]], job.image_size, one)
        except SampleDecodeError:
            return False
        return True

    def _from_cached(
        self, job: Job, images: Sequence[np.ndarray | None], ready: list[int], out: np.ndarray | None = None
    ) -> np.ndarray:
        """Crop, resize and mirror cached images ``ready`` (positions in the job)."""
        crops = job.crops
        if crops is None:
            raise ConfigError("decoded cache: a job without crop windows")
        chosen = [images[k] for k in ready]
        cached = [image for image in chosen if image is not None]
        rows = np.asarray(job.indices)[ready]
        shapes = np.array([image.shape[:2] for image in cached], dtype=np.int64).reshape(-1, 2)
        windows = cached_windows(crops.boxes[ready], self._split.widths[rows], self._split.heights[rows], shapes)
        views = [image[y0:y1, x0:x1] for image, (x0, y0, x1, y1) in zip(cached, windows)]
        return self._resizer.resize(views, job.image_size, crops.flips[ready], self.spec.antialias, out=out)

    def _parallel(self, work: Callable[[_Item], _Result], items: list[_Item]) -> list[_Result]:
        """``[work(x) for x in items]`` in contiguous slices on the pool and this thread
        (the decoder releases the GIL)."""
        bounds = np.linspace(0, len(items), self.spec.threads + 1).astype(int)
        slices = [items[a:b] for a, b in zip(bounds[:-1], bounds[1:]) if b > a]
        futures = [self._pool.submit(lambda part: [work(x) for x in part], part) for part in slices[1:]]
        results = [work(x) for x in slices[0]] if slices else []
        for future in futures:
            results.extend(future.result())
        return results

    @property
    def device_copies(self) -> int:
        return self.inner.device_copies

    @property
    def host_copies(self) -> int:
        return self.inner.host_copies

    def drain(self) -> None:
        """Collect and drop whatever the inner runner still has in flight."""
        self.inner.drain()

    def close(self) -> None:
        """Stop this runner's threads (the inner runner stays with its owner)."""
        self._resizer.close()
        self._pool.shutdown(wait=False)
