"""Check and normalise inputs, in order, with decode work spread over processes.

Each input is read (a few threads read ahead) and checked without decoding
(``check_without_decode``): bad headers and images over ``--max-pixels`` are
rejected right there. With one worker that is the writing process's work; with N,
N - 1 worker processes read and check their own inputs, a run of 16 per task, and
the writing process takes a run itself whenever every worker has its tasks at hand
(so N processes work, not N + 1 on N cores). When the writing process read, checked
and pickled every input for the workers, it was the one process every image waited
on: ``--workers 2`` was 1.1x ``--workers 1`` on two cores. With ``--check header`` valid JPEGs pass
through from there too; with ``--check decode`` (the default) they go to the worker
pool to be checked, as do inputs that need re-encoding (odd formats, ``--max-side-px``,
``--quality``). Every accepted JPEG is rewritten losslessly with restart markers on
the workers (``--restart-interval``, ``shards.jpeg.add_restarts``; 0 stores them as
they come); that rewrite reads every coefficient, so its warnings are the decode
check (a full OpenCV decode checks instead when there is no rewrite). With
``--half-copies`` the workers also make each image's half-scale copy.
Results come back in input order, whatever order the workers finish in, so the
output does not depend on the number of workers.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from collections import deque
from collections.abc import Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.pool import AsyncResult, Pool

import cv2
import numpy as np

from sharder.config import ShardConfig
from sharder.images import ProcessedImage, check_by_decode, check_without_decode, decode_and_reencode
from sharder.source_reads import Source, read_input
from shards import jpeg

__all__ = ["HALF_COPY_QUALITY", "options_of", "process_files", "processed_in_order", "with_half_copy", "with_restarts",
           "worker_pool"]

# Quality of the half-scale copies. Measured on the sample data at 128 px outputs of
# windows at least 256 px: copies at 90 differ from decoding the image itself at
# scale 1/2 by 0.4 levels (mean absolute, after the resize), at 95 by 0.15 but 40 %
# larger; at 90 a copy is about a third of its image's bytes.
HALF_COPY_QUALITY = 90

# Inputs in flight per worker: enough to keep every worker busy while the writer
# waits for the oldest one; bounds memory to a few images per worker.
_IN_FLIGHT_PER_WORKER = 8
# Inputs per task of a worker process: fewer tasks, fewer wake-ups and messages.
_PER_TASK = 16
# Tasks in flight per worker: one running, the others queued, so that a worker that
# finishes while the writer waits for an older task has the next one at hand.
_TASKS_PER_WORKER = 4
# Files read ahead by threads (reads release the GIL): hides disk and network-file-
# system latency, which dominates on a cold cache; bounds memory to this many files.
_READ_THREADS = 8
_READ_AHEAD = 64


@contextmanager
def worker_pool(workers: int, readers: Iterable[Source] = ()) -> Iterator[Pool | None]:
    """Processes that decode and re-encode inputs beside this one, which takes its
    share as well (``workers - 1`` of them; None: this process does it all).

    Forked, not spawned: a spawned worker would re-import the program's main module
    (the whole CLI) before doing any work. Create the pool before starting threads.
    Where one of ``readers`` cannot be used after a fork (a store's client, once this
    process used it), the workers are forked from a fresh server process instead
    (``forkserver``, the image modules loaded there once).
    """
    if workers == 1:
        yield None
        return
    method = "fork" if all(reader.fork_safe for reader in readers) else "forkserver"
    context = multiprocessing.get_context(method)
    if method == "forkserver":
        context.set_forkserver_preload([__name__])
    with context.Pool(workers - 1, initializer=_ignore_interrupts) as pool:
        yield pool


def _ignore_interrupts() -> None:
    # Ctrl-C reaches the whole process group; the writer handles it and ends the pool.
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _reencode(data: bytes, max_side_px: int | None, quality: int, max_pixels: int, check: str,
              restart_interval: int, half_copy: bool) -> ProcessedImage:
    image = decode_and_reencode(data, max_side_px=max_side_px, quality=quality, max_pixels=max_pixels, check=check)
    return _stored(image, restart_interval, half_copy)


def _check(accepted: ProcessedImage, max_pixels: int, restart_interval: int, half_copy: bool) -> ProcessedImage:
    if restart_interval:
        # The rewrite entropy-decodes every coefficient: its warnings are the check.
        return _stored(accepted, restart_interval, half_copy, strict=True)
    return _stored(check_by_decode(accepted, max_pixels), 0, half_copy)


def _stored(image: ProcessedImage, restart_interval: int, half_copy: bool, strict: bool = False) -> ProcessedImage:
    """``image`` as it is stored: with restart markers, and its half-scale copy."""
    image = with_restarts(image, restart_interval, strict=strict)
    return with_half_copy(image, restart_interval) if half_copy else image


def with_half_copy(image: ProcessedImage, restart_interval: int) -> ProcessedImage:
    """``image`` with its half-scale copy: decoded at DCT scale 1/2 (libjpeg's own
    reduced IDCT, ``ceil(width / 2) x ceil(height / 2)``, as the daemon decodes a
    window at least twice its output), encoded at ``HALF_COPY_QUALITY`` (4:2:0,
    optimised Huffman tables) with restart intervals that tile the MCU rows, as
    ``shards.jpeg.add_restarts`` writes them, in the same pass (``restart_interval``
    0: none). A reject, and an image whose copy cannot be made, stay as they are (the
    image without a copy is still served, from itself)."""
    if image.reject:
        return image
    flags = cv2.IMREAD_REDUCED_COLOR_2 | cv2.IMREAD_IGNORE_ORIENTATION  # the stored pixel grid
    pixels = cv2.imdecode(np.frombuffer(image.data, dtype=np.uint8), flags)
    expected = ((image.height + 1) // 2, (image.width + 1) // 2)
    if pixels is None or pixels.shape[:2] != expected:
        return image
    options = [cv2.IMWRITE_JPEG_QUALITY, HALF_COPY_QUALITY, cv2.IMWRITE_JPEG_OPTIMIZE, 1,
               cv2.IMWRITE_JPEG_SAMPLING_FACTOR, cv2.IMWRITE_JPEG_SAMPLING_FACTOR_420]
    if restart_interval:  # (non-zero only where the JPEG library is built: ShardConfig.stored_restart_interval)
        options += [cv2.IMWRITE_JPEG_RST_INTERVAL, jpeg.tiling_interval(-(-expected[1] // _MCU_420), restart_interval)]
    done, encoded = cv2.imencode(".jpg", pixels, options)
    return replace(image, half=encoded.tobytes()) if done else image


_MCU_420 = 16  # px: an MCU's width in a 4:2:0 JPEG


def with_restarts(image: ProcessedImage, restart_interval: int, strict: bool = False) -> ProcessedImage:
    """``image`` with its JPEG rewritten losslessly with restart markers
    (``shards.jpeg.add_restarts``); as it is with ``restart_interval`` 0, for a
    reject, or without the JPEG library; a reject if libjpeg-turbo cannot read it
    (or, ``strict``, warns about corrupt data while reading it)."""
    if image.reject or restart_interval == 0 or not jpeg.available():
        return image
    try:
        return replace(image, data=jpeg.add_restarts(image.data, restart_interval, strict=strict))
    except jpeg.JpegError as e:
        kind = "truncated" if "premature end" in str(e) else "corrupt"
        return ProcessedImage(reject=f"{kind} JPEG: {e}")


def _read_ahead(source: Source, names: list[str]) -> Iterator[bytes | ProcessedImage]:
    """``read_input`` of each name, in order, read by a few threads ahead of the caller."""
    with ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="shard-read") as readers:
        pending: deque[Future] = deque()
        for name in names:
            pending.append(readers.submit(read_input, source, name))
            if len(pending) >= _READ_AHEAD:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()


def _process(data: bytes | ProcessedImage, options: tuple) -> ProcessedImage:
    """The outcome for one input's content (``options``: :func:`_options`)."""
    if isinstance(data, ProcessedImage):
        return data
    max_side_px, quality, reencode_quality, max_pixels, check, interval, half = options
    quick = check_without_decode(data, max_side_px=max_side_px, quality=quality, max_pixels=max_pixels)
    if quick is not None and quick.reject:
        return quick
    if quick is not None and check == "header":
        return quick if interval == 0 and not half else _stored(quick, interval, half)
    if quick is not None:
        return _check(quick, max_pixels, interval, half)
    return _reencode(data, max_side_px, reencode_quality, max_pixels, check, interval, half)


def options_of(config: ShardConfig) -> tuple:
    return (config.max_side_px, config.quality, config.reencode_quality, config.max_pixels, config.check,
            config.stored_restart_interval, config.half_copies)


# Each process's reader threads, made at its first task: (pid, threads). A process
# forked later has none of its parent's threads, so it makes its own.
_readers: tuple[int, ThreadPoolExecutor] | None = None


def process_files(source: Source, names: list[str], options: tuple) -> list[ProcessedImage]:
    """A task: read a run of inputs (together, as a read-ahead would) and process each."""
    global _readers
    if _readers is None or _readers[0] != os.getpid():
        _readers = (os.getpid(), ThreadPoolExecutor(_READ_THREADS, thread_name_prefix="shard-read"))
    return [_process(data, options) for data in _readers[1].map(lambda name: read_input(source, name), names)]


def processed_in_order(config: ShardConfig, source: Source, names: list[str],
                       pool: Pool | None) -> Iterator[ProcessedImage]:
    """The outcome for each input of ``names``, in the same order.

    Args:
        config: image options (``max_side_px``, ``quality``).
        source: reads the inputs.
        names: their source names.
        pool: from ``worker_pool`` (None: read and process in this process).

    Yields:
        One ProcessedImage per name.
    """
    options = options_of(config)
    copied = (config.check == "header" and not config.stored_restart_interval and not config.half_copies
              and config.max_side_px is None and config.quality is None)
    if pool is None or copied:  # valid JPEGs only checked and copied: less work than sending them
        for data in _read_ahead(source, names):
            yield _process(data, options)
        return
    # Tasks in input order: a worker's (its result to come) or this process's own (done),
    # which it takes whenever every worker has its tasks at hand, rather than wait.
    tasks: deque[AsyncResult | list[ProcessedImage]] = deque()
    at_workers, most = 0, _TASKS_PER_WORKER * config.workers
    for start in range(0, len(names), _PER_TASK):
        run = names[start:start + _PER_TASK]
        if at_workers < _TASKS_PER_WORKER * (config.workers - 1):
            tasks.append(pool.apply_async(process_files, (source.for_names(run), run, options)))  # its offsets only
            at_workers += 1
        else:
            tasks.append(process_files(source, run, options))
        while tasks and (len(tasks) > most or isinstance(tasks[0], list) or tasks[0].ready()):
            done = tasks.popleft()
            if not isinstance(done, list):
                at_workers -= 1
                done = done.get()
            yield from done
    for task in tasks:
        yield from task if isinstance(task, list) else task.get()
