"""``feeder shard SRC s3://bucket/prefix``: shard into a local stage and upload there.

The run is :func:`sharder.shard.shard` into ``config.stage_dir``; each shard is
uploaded (in parts of 64 MiB above 1 GiB) as soon as it is durable in the stage,
by one uploader thread while the next shard is written, and removed from the stage
once stored (with ``lmdb``, whose database is built from the tars, at the end). The
indexes and LMDB follow when the run is done, the manifest last: a reader never
finds a manifest whose files are not all there (an object appears whole or not at
all), and a manifest in the store means the dataset is complete.

A killed run is run again with the same command: the sharder resumes from the
stage, and what the store already holds at the right size is not uploaded again.
A store prefix that holds a dataset, or objects of another run, is refused unless
``--overwrite`` (which deletes the manifest first, then the rest).
"""

from __future__ import annotations

import json
import logging
import queue
import shutil
import threading
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from core.errors import ConfigError, DataError, NotFound
from sharder.config import ShardConfig
from sharder.shard import WORK_DIR, ShardReport, shard, split_counts
from shards.layout import MANIFEST_NAME, shard_name
from shards.manifest import Manifest, read_manifest
from shards.objects import ObjectUrl
from shards.store import ObjectInfo, ObjectStore, StoreOptions

__all__ = ["UploadReport", "shard_to_store"]

log = logging.getLogger(__name__)

_QUEUED_SHARDS = 4  # finished shards waiting for upload before the sharder waits too


@dataclass
class UploadReport(ShardReport):
    """A run's report, with where it went and what was uploaded."""

    url: str = ""
    uploaded_files: int = 0
    uploaded_bytes: int = 0

    def summary(self) -> str:
        head = super().summary().rsplit(" -> ", 1)[0]
        return (f"{head} -> {self.url} (uploaded {self.uploaded_files} files, "
                f"{self.uploaded_bytes / 1e6:.1f} MB)")


class _Uploader:
    """Uploads staged files in a thread of its own, skipping what the store has."""

    def __init__(self, store: ObjectStore, stage: Path, held: dict[str, ObjectInfo], keep_tars: bool) -> None:
        self.store, self.stage, self.held, self.keep_tars = store, stage, held, keep_tars
        self.files = self.bytes = 0
        self._queue: queue.Queue[str | None] = queue.Queue(_QUEUED_SHARDS)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="feeder-upload", daemon=True)
        self._thread.start()

    def put(self, name: str) -> None:
        """Upload ``name`` (relative to the stage) unless the store has it at its size.

        Raises:
            FeederError: the store refused an earlier upload (or stopped answering).
        """
        path = self.stage / name
        size = path.stat().st_size
        if self.held.get(name, ObjectInfo(-1, None)).size != size:
            self.store.put_file(name, path)
            self.held[name] = ObjectInfo(size, None)
            self.files, self.bytes = self.files + 1, self.bytes + size

    def shard_done(self, split: str, number: int) -> None:
        """``on_shard_done``: queue the shard's tar and ``.idx`` (waits while
        ``_QUEUED_SHARDS`` are queued)."""
        self.raise_failure()
        self._queue.put(f"{split}/{shard_name(number)}")

    def _run(self) -> None:
        while (tar := self._queue.get()) is not None:
            if self._error is not None:
                continue
            try:
                self._upload_shard(tar)
            except BaseException as e:  # kept for the sharder's thread to raise
                self._error = e

    def _upload_shard(self, tar: str) -> None:
        idx = tar.removesuffix(".tar") + ".idx"
        for name in (tar, idx):
            if (self.stage / name).is_file():
                self.put(name)
        if not self.keep_tars:
            for name in (tar, idx):
                (self.stage / name).unlink(missing_ok=True)

    def raise_failure(self) -> None:
        if self._error is not None:
            raise self._error

    def finish(self) -> None:
        """Wait for the queued shards.

        Raises:
            FeederError: one of them could not be uploaded.
        """
        self._queue.put(None)
        self._thread.join()
        self.raise_failure()


def _store(config: ShardConfig) -> tuple[ObjectStore, ObjectUrl]:
    url = ObjectUrl.parse(config.upload_to or "")
    return ObjectStore(url, StoreOptions(endpoint_url=config.s3_endpoint)), url


def _staged_manifest(config: ShardConfig) -> Manifest | None:
    """The manifest of a finished run of the same source and options in the stage
    (its upload was cut short), or None."""
    path = config.out / MANIFEST_NAME
    if not path.is_file() or (config.out / WORK_DIR).exists():
        return None
    try:
        manifest = read_manifest(config.out)
    except (DataError, NotFound):
        return None
    same = manifest.source == config.source_name and manifest.options == config.options()
    return manifest if same else None


def _prepare_store(config: ShardConfig, store: ObjectStore, resuming: bool) -> dict[str, ObjectInfo]:
    """What the store holds under the URL, once it is fit for this run.

    Raises:
        ConfigError: it holds a dataset or other objects and this is neither a resumed
            run nor ``--overwrite``.
    """
    held = store.listing()
    if held and config.overwrite:
        names = sorted(held, key=lambda name: name != MANIFEST_NAME)  # the manifest first: no reader starts
        store.delete(names)
        log.info("deleted %d objects under %s (--overwrite)", len(names), config.upload_to)
        return {}
    if held and not resuming:
        what = "holds a dataset" if MANIFEST_NAME in held else f"holds {len(held)} objects of another run"
        raise ConfigError(f"OUT {config.upload_to} {what} (use --overwrite to replace it)")
    return held


def shard_to_store(config: ShardConfig) -> UploadReport:
    """Shard ``config.src`` and upload the result to ``config.upload_to`` (see the
    module's docstring).

    Raises:
        ConfigError: ``config`` has no store URL, or the store's prefix is not fit
            for this run (see :func:`_prepare_store`).
        NotFound, Unauthenticated, ServiceUnavailable: the bucket does not exist, the
            store refused the credentials, or it could not be reached (naming the URL).
        DataError: as :func:`sharder.shard.shard`.
    """
    if config.upload_to is None:
        raise ConfigError("shard_to_store: OUT is not an object store URL")
    store, url = _store(config)
    staged = _staged_manifest(config)
    resuming = staged is not None or (config.out / WORK_DIR).is_dir()
    if config.overwrite and config.out.is_dir():
        shutil.rmtree(config.out)
        staged, resuming = None, False
    held = _prepare_store(config, store, resuming)
    if MANIFEST_NAME in held and staged is not None:
        log.info("%s already holds this run's manifest; checking its files", url)
    uploader = _Uploader(store, config.out, held, keep_tars="lmdb" in config.formats)
    report = _run(config, staged, uploader)
    _upload_rest(config.out, uploader)
    shutil.rmtree(config.out, ignore_errors=True)
    return UploadReport(out=report.out, splits=report.splits, seconds=report.seconds, url=str(url),
                        uploaded_files=uploader.files, uploaded_bytes=uploader.bytes)


def _run(config: ShardConfig, staged: Manifest | None, uploader: _Uploader) -> ShardReport:
    """The sharding run into the stage, uploading shards as they are done (or, where
    it finished before, the report of its manifest)."""
    if staged is not None:
        uploader.finish()
        return _report_of(config.out, staged)
    chained: Callable[[str, int], None] = uploader.shard_done
    if config.on_shard_done is not None:
        user = config.on_shard_done

        def chained(split: str, number: int) -> None:
            uploader.shard_done(split, number)
            user(split, number)

    _upload_recorded(config.out, uploader)
    try:
        report = shard(replace(config, out=config.out, on_shard_done=chained, overwrite=False))
    finally:
        uploader.finish()
    return report


def _upload_recorded(stage: Path, uploader: _Uploader) -> None:
    """Shards a killed run recorded as done: upload those still staged, check the
    others are in the store.

    Raises:
        DataError: a recorded shard neither staged nor in the store.
    """
    for record in sorted((stage / WORK_DIR).glob("*/shard-*.json")):
        tar = f"{record.parent.name}/{record.stem}.tar"
        if (stage / tar).is_file():
            uploader.shard_done(record.parent.name, int(record.stem.split("-")[1]))
        elif tar not in uploader.held and json.loads(record.read_text()).get("path"):
            raise DataError(f"{uploader.store.url(tar)}: recorded as uploaded, but neither in the store nor in "
                            f"the stage {stage}; run again with --overwrite")


def _upload_rest(stage: Path, uploader: _Uploader) -> None:
    """Everything else in the stage (indexes, LMDB, tars not yet stored), then the manifest."""
    for path in sorted(p for p in stage.rglob("*") if p.is_file()):
        name = path.relative_to(stage).as_posix()
        if name != MANIFEST_NAME and not name.startswith(f"{WORK_DIR}/"):
            uploader.put(name)
    uploader.put(MANIFEST_NAME)


def _report_of(stage: Path, manifest: Manifest) -> ShardReport:
    return ShardReport(stage, splits={name: split_counts(entry) for name, entry in manifest.splits.items()})
