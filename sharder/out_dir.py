"""OUT of ``feeder shard``: what it may be, how a run takes it over (new, replaced with
``--overwrite``, or an unfinished run of the same inputs and options resumed), and
errors writing into it told in one line.

A write into OUT that fails (a full disk, a quota, a file too large, a read-only
file system, no permission) ends the run with one line naming the file and the
reason: everything finished so far is kept (see :mod:`sharder.split_writer`), and the
same command resumes once the cause is gone.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from core.errors import ConfigError, os_error_reason
from sharder.config import ShardConfig
from sharder.out_lock import LOCK_NAME
from sharder.sources import SourceTree
from shards.writers import write_json_atomic

__all__ = ["WORK_DIR", "check_out_path", "prepare_out", "run_identity", "write_errors_named"]

WORK_DIR = ".work"  # resume state of an unfinished run; removed when the run completes
_RUN_FILE = "run.json"

_NO_ROOM = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}
_NOT_WRITABLE = {errno.EROFS, errno.EACCES, errno.EPERM}


def check_out_path(config: ShardConfig) -> None:
    """OUT may be created or reused: it is not a file and does not overlap SRC.

    Raises:
        ConfigError: it is, or it does.
    """
    out, resolved = config.out, config.out.resolve()
    src = config.src.resolve() if isinstance(config.src, Path) else None  # a store URL overlaps no folder
    if src is not None and (resolved == src or resolved in src.parents or src in resolved.parents):
        raise ConfigError(f"OUT {out} and SRC {config.src} overlap; shard into a folder outside SRC")
    if out.exists() and not out.is_dir():
        raise ConfigError(f"OUT {out} exists and is not a directory")


def run_identity(config: ShardConfig, tree: SourceTree) -> dict[str, Any]:
    """What must not change between a killed run and its resumption: SRC, its inputs
    (paths and labels) and the options."""
    listing = hashlib.sha256()
    for split in tree.splits:
        for item in split.files:
            listing.update(f"{split.name}\t{item.source}\t{item.label}\n".encode())
    return {"source": config.source_name, "inputs_sha256": listing.hexdigest(), "options": config.options()}


def _contents(out: Path) -> list[Path]:
    """What OUT holds, but for the lock of the run (``sharder.out_lock``)."""
    return [child for child in out.iterdir() if child.name != LOCK_NAME] if out.is_dir() else []


def prepare_out(config: ShardConfig, identity: dict[str, Any]) -> None:
    """Accept OUT as empty (or new), clear it (--overwrite), or accept it as an
    unfinished run to resume (the same ``identity``, :func:`run_identity`); then
    record ``identity`` in it. The caller holds OUT's lock.

    Raises:
        ConfigError: OUT is not empty, holds another run, or is not writable.
    """
    out, run_file = config.out, config.out / WORK_DIR / _RUN_FILE
    resumable = run_file.is_file() and json.loads(run_file.read_text()) == identity
    if _contents(out) and not resumable and not config.overwrite:
        what = "holds an unfinished run of other inputs or options" if run_file.is_file() else "is not empty"
        raise ConfigError(f"OUT {out} {what} (use --overwrite to replace its contents)")
    if config.overwrite:
        for child in _contents(out):
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    try:
        (out / WORK_DIR).mkdir(parents=True, exist_ok=True)
        write_json_atomic(run_file, identity)
    except OSError as e:
        raise ConfigError(f"cannot write to OUT {out}: {os_error_reason(e)}") from e


def _inside(filename: object, out: Path) -> bool:
    if not isinstance(filename, str):
        return False
    path, root = os.path.abspath(filename), os.path.abspath(out)  # not resolved: a link stays where it is
    return os.path.commonpath([path, root]) == root


def _resume_hint(code: int | None) -> str:
    if code in _NO_ROOM:
        return "resume with the same command once there is room"
    if code in _NOT_WRITABLE:
        return "resume with the same command once OUT is writable"
    return "run the same command again to resume"


@contextmanager
def write_errors_named(out: Path) -> Iterator[None]:
    """An ``OSError`` raised inside while writing a file in ``out`` (its ``filename``
    inside OUT, or no file named and an errno only writes give: no room, a read-only
    file system) becomes one line: the file, the reason and how to go on.

    Raises:
        ConfigError: ``out/train/shard-000003.tar: no space left on device (resume
            with the same command once there is room)``.
    """
    try:
        yield
    except OSError as e:
        unnamed = e.filename is None and e.errno in _NO_ROOM | {errno.EROFS}
        if not (_inside(e.filename, out) or unnamed):
            raise
        where = e.filename if e.filename is not None else f"OUT {out}"
        raise ConfigError(f"{where}: {os_error_reason(e)} ({_resume_hint(e.errno)})") from e
