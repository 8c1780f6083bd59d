"""Frozen configuration objects for the sharder, built once by the CLI and passed down.

Importable without Pillow or OpenCV: ``feeder --help`` builds the sharder's commands
from these classes.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from core.bad_input import DEFAULT_MAX_PIXELS, ON_ERROR
from core.cpus import capped_workers
from core.errors import ConfigError
from core.fields import cli
from shards.objects import ObjectUrl, is_remote, local_path
from shards.store import StoreOptions

__all__ = [
    "CHECKS", "DEFAULT_RESTART_INTERVAL", "FORMATS", "ON_ERROR_POLICIES", "SampleDataConfig", "ShardConfig",
    "VerifyConfig", "check_endpoint", "on_error_policy", "progress_shown", "stage_dir_for",
]

FORMATS = ("wds", "lmdb")
CHECKS = ("decode", "header")
ON_ERROR_POLICIES = ON_ERROR  # the sharder's words are the daemon's

# shards.jpeg.DEFAULT_RESTART_INTERVAL, not imported here because that module loads
# OpenCV (tests/sharder/test_config.py checks that the two agree).
DEFAULT_RESTART_INTERVAL = 2

# Quality used when an odd input (CMYK, PNG, 16-bit, ...) is normalised to RGB JPEG and
# no --quality was given: high enough that the re-encoding costs no accuracy.
DEFAULT_REENCODE_QUALITY = 95

_MIB = 1 << 20


def on_error_policy(value: str) -> str:
    """``value``, checked to be one of ``ON_ERROR``.

    Raises:
        ConfigError: any other word.
    """
    if value not in ON_ERROR:
        raise ConfigError(f"--on-error must be one of {', '.join(ON_ERROR)}, got {value!r}")
    return value


def progress_shown(progress: bool | None) -> bool:
    """Whether to draw a progress bar: ``progress``, or when it is None, whether
    stderr is a terminal (so library callers and tests get none unless on one)."""
    return sys.stderr.isatty() if progress is None else progress


def _shard_dir(text: str, option: str) -> Path | str:
    """OUT of ``feeder shard`` / ``feeder verify``: a local path, or an object store
    URL (kept as its text).

    Raises:
        ConfigError: a store URL that cannot be (names it).
    """
    if is_remote(text):
        return str(ObjectUrl.parse(text))
    return local_path(text)


def stage_dir_for(url: str) -> Path:
    """Where ``feeder shard SRC URL`` stages its shards by default: under
    ``$XDG_CACHE_HOME/feeder/stage`` (``~/.cache``), one folder per URL, so a rerun
    finds what a killed run left."""
    parsed = ObjectUrl.parse(url)
    base = Path(os.environ.get("XDG_CACHE_HOME") or "~/.cache").expanduser()
    return base / "feeder" / "stage" / parsed.scheme / parsed.bucket / (parsed.key or "_")


def check_endpoint(endpoint: str | None) -> None:
    """Raises ConfigError: ``endpoint`` is not an http(s) URL."""
    if endpoint is not None and not endpoint.startswith(("http://", "https://")):
        raise ConfigError(f"--s3-endpoint {endpoint!r}: not an http:// or https:// URL")


@dataclass(frozen=True)
class ShardConfig:
    """Everything ``sharder.shard`` needs.

    Args:
        src: input tree: the ILSVRC2012 layout (train/, val/) or a plain class-folder
            tree; or a folder holding the image-net.org tars (ILSVRC2012_img_train.tar,
            ILSVRC2012_img_val.tar, ILSVRC2012_devkit_t12.tar.gz), read where they lie;
            or an object store URL (s3://bucket/prefix) holding either.
        out: shard directory to create, or to resume into (an unfinished run of the
            same inputs and options continues where it stopped); or an object store
            URL (s3://bucket/prefix): shards are staged in ``stage_dir``, each
            uploaded once finished, the manifest last (``sharder.upload``).
        formats: what to write, from wds and lmdb (``FORMATS``; on the command line a
            comma list, e.g. wds,lmdb); wds tars are the primary format.
        seed: seed of the global shuffle (same SRC + seed -> byte-identical output).
        shard_size_bytes: a tar is closed before it would grow past this size.
            Example: 256M.
        workers: processes that read and normalise images, this one included (1 =
            in this process alone): they decode for ``check`` decode, odd formats,
            ``max_side_px`` and ``quality``.
        max_side_px: downscale images whose longer side exceeds this many pixels;
            None, the default: never.
        quality: re-encode every image at this JPEG quality; None, the default: pass
            valid JPEGs through and normalise odd files at ``DEFAULT_REENCODE_QUALITY``
            (95).
        check: ``decode`` entropy-decodes every image (on the workers) before
            accepting it (the restart-marker rewrite reads every coefficient; with
            ``restart_interval`` 0, a full decode) and rejects it on any decoder
            warning; ``header`` checks a pass-through JPEG's headers and end marker
            only (faster, lets corrupt image data through).
        max_pixels: images with more pixels are rejected before any decode
            (decompression bombs), or downscaled when ``max_side_px`` is given.
            Default: Pillow's own bomb threshold, about 9459 x 9459, far above camera
            photos.
        restart_interval: every stored JPEG is rewritten losslessly (same pixels) with
            a restart marker about every this many MCUs (``shards.jpeg.add_restarts``),
            so a crop window decodes about only its own area (1.5 % larger files at
            2); 0 stores JPEGs as they come (pass-through byte for byte). Without the
            JPEG library (not built) JPEGs are stored as they come, with a warning.
        half_copies: also store each image decoded at DCT scale 1/2 and re-encoded
            (``HALF_COPY_QUALITY``, the same restart markers) as ``<key>.half.jpg``;
            a crop window at least twice the output on both sides is decoded from it
            (the low-resolution phases of a progressive-resizing schedule), for about
            a third more bytes.
        on_error: ``skip`` records a bad input and goes on; ``fail`` stops at the
            first (``raise``, its old name, still means ``fail``).
        overwrite: allow a non-empty OUT (its contents are replaced).
        progress: show a progress bar on stderr; None, the default: only when stderr
            is a terminal.
        s3_endpoint: the S3 API of an S3-compatible store for a ``src`` or ``out`` URL, e.g.
            http://127.0.0.1:8333; default: AWS_ENDPOINT_URL, else AWS itself.
        stage_dir: where shards for an ``out`` URL are written before they are
            uploaded (a killed run resumes from it); default:
            ~/.cache/feeder/stage/SCHEME/BUCKET/PREFIX. Uploaded tars are removed from it
            (with lmdb, at the end).
        ray: read and normalise the images in Ray tasks over the nodes of the Ray
            cluster at this address (``auto``: the cluster this node is part of, or
            RAY_ADDRESS; ``local``: one started on this machine for the run); SRC and
            OUT must be where every node can reach them (a shared file system, an
            object store). The output is the same bytes as without. Needs
            ``pip install 'feeder[ray]'``. Default: no Ray (``workers`` processes).
        ray_tasks_per_node: with ``ray``, tasks in flight per node; default: four per
            CPU of the cluster.
        on_shard_done: called with (split, shard number) after each shard is durable.
    """

    src: Path | str = field(metadata=cli(argument=True, parse=_shard_dir))
    out: Path = field(metadata=cli(argument=True, parse=_shard_dir))
    formats: tuple[str, ...] = field(default=("wds",), metadata=cli(metavar="wds,lmdb"))
    seed: int = 0
    shard_size_bytes: int = 256 << 20
    workers: int = 1
    max_side_px: int | None = None
    quality: int | None = None
    check: str = "decode"
    max_pixels: int = DEFAULT_MAX_PIXELS
    restart_interval: int = DEFAULT_RESTART_INTERVAL
    half_copies: bool = False
    on_error: str = "skip"
    overwrite: bool = False
    progress: bool | None = None
    s3_endpoint: str | None = None
    stage_dir: Path | None = None
    ray: str | None = None
    ray_tasks_per_node: int | None = None
    on_shard_done: Callable[[str, int], None] | None = field(default=None, compare=False,
                                                             metadata=cli(excluded=True))
    # The object store URL ``out`` was given as (``out`` is then the stage), or None.
    upload_to: str | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        remote_src = isinstance(self.src, str) and is_remote(self.src)
        object.__setattr__(self, "src", str(ObjectUrl.parse(str(self.src))) if remote_src else Path(self.src))
        if isinstance(self.out, str) and is_remote(self.out):
            url = str(ObjectUrl.parse(self.out))
            object.__setattr__(self, "upload_to", url)
            object.__setattr__(self, "out", Path(self.stage_dir) if self.stage_dir is not None else stage_dir_for(url))
        object.__setattr__(self, "out", Path(self.out))
        check_endpoint(self.s3_endpoint)
        unknown = [f for f in self.formats if f not in FORMATS]
        if unknown or not self.formats:
            raise ConfigError(f"--formats must be a comma list of {', '.join(FORMATS)}, got {','.join(self.formats)!r}")
        if len(set(self.formats)) != len(self.formats):
            raise ConfigError(f"--formats lists a format twice: {','.join(self.formats)!r}")
        if self.shard_size_bytes < 1024:
            raise ConfigError(f"--shard-size-bytes must be at least 1K, got {self.shard_size_bytes} bytes")
        if self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        if self.ray is None:  # with Ray the cluster's CPUs set the tasks
            object.__setattr__(self, "workers", capped_workers(self.workers, "--workers"))
        if self.ray_tasks_per_node is not None and (self.ray is None or self.ray_tasks_per_node < 1):
            raise ConfigError(f"--ray-tasks-per-node must be >= 1 and goes with --ray, got {self.ray_tasks_per_node}")
        if self.max_side_px is not None and self.max_side_px < 16:
            raise ConfigError(f"--max-side-px must be >= 16 px, got {self.max_side_px}")
        if self.quality is not None and not 1 <= self.quality <= 100:
            raise ConfigError(f"--quality must be in 1..100, got {self.quality}")
        if self.check not in CHECKS:
            raise ConfigError(f"--check must be one of {', '.join(CHECKS)}, got {self.check!r}")
        if self.max_pixels < 256:
            raise ConfigError(f"--max-pixels must be >= 256, got {self.max_pixels}")
        if not 0 <= self.restart_interval <= 64:
            raise ConfigError(f"--restart-interval must be in 0..64 MCUs, got {self.restart_interval}")
        object.__setattr__(self, "on_error", on_error_policy(self.on_error))

    @property
    def store_options(self) -> StoreOptions:
        """How a store SRC (or OUT) is talked to."""
        return StoreOptions(endpoint_url=self.s3_endpoint)

    @property
    def source_name(self) -> str:
        """SRC as the manifest records it: its URL, or its resolved path."""
        return self.src if isinstance(self.src, str) else str(self.src.resolve())

    @property
    def reencode_quality(self) -> int:
        """JPEG quality of every image this run re-encodes."""
        return self.quality if self.quality is not None else DEFAULT_REENCODE_QUALITY

    @property
    def stored_restart_interval(self) -> int:
        """``restart_interval`` as it takes effect: 0 without the JPEG library."""
        from shards import jpeg

        return self.restart_interval if jpeg.available() else 0

    def options(self) -> dict:
        """The options that decide the output bytes, as recorded in the manifest."""
        return {
            "formats": list(self.formats),
            "seed": self.seed,
            "shard_size_bytes": self.shard_size_bytes,
            "max_side_px": self.max_side_px,
            "quality": self.quality,
            "reencode_quality": self.reencode_quality,
            "check": self.check,
            "max_pixels": self.max_pixels,
            "restart_interval": self.stored_restart_interval,
            "half_copies": self.half_copies,
            "on_error": self.on_error,
        }


@dataclass(frozen=True)
class SampleDataConfig:
    """Options of ``sharder.sample_data.make_sample_data``.

    Args:
        out: directory to create (must be empty or absent), e.g. data/sample.
        classes: number of classes, one per bundled photograph.
        train_per_class: training images per class.
        val_per_class: validation images per class.
        seed: same seed -> byte-identical files.
        min_side_px: smallest side of the output images, pixels (ImageNet-like 300 by
            default; tests use small sizes for speed).
        max_side_px: largest side of the output images, pixels.
        progress: show a progress bar on stderr; None, the default: only when stderr
            is a terminal.
    """

    out: Path = field(metadata=cli(argument=True))
    classes: int = 10
    train_per_class: int = 100
    val_per_class: int = 10
    seed: int = 0
    min_side_px: int = 300
    max_side_px: int = 500
    progress: bool | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "out", Path(self.out))
        if self.classes < 1:
            raise ConfigError(f"--classes must be >= 1, got {self.classes}")
        if self.train_per_class < 1 or self.val_per_class < 0:
            raise ConfigError("--train-per-class must be >= 1 and --val-per-class >= 0")
        if not 16 <= self.min_side_px <= self.max_side_px:
            raise ConfigError(f"image sides must satisfy 16 <= min <= max, got {self.min_side_px}..{self.max_side_px}")


@dataclass(frozen=True)
class VerifyConfig:
    """What ``sharder.verify.verify`` checks, and how.

    Args:
        out: shard directory made by ``feeder shard``: a path, or an object store URL
            (s3://bucket/prefix; each shard is downloaded to a temporary folder to be
            checked, at most 2 GiB of them kept at once).
        full: decode every image, not only a seeded sample of each split.
        seed: seed choosing the decoded sample.
        progress: show a progress bar (shards checked) on stderr; None, the default:
            only when stderr is a terminal.
        s3_endpoint: the S3 API of an S3-compatible store for an ``out`` URL; default:
            AWS_ENDPOINT_URL, else AWS itself.
    """

    out: Path | str = field(metadata=cli(argument=True, parse=_shard_dir))
    full: bool = False
    seed: int = 0
    progress: bool | None = None
    s3_endpoint: str | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.out, str) and is_remote(self.out)):
            object.__setattr__(self, "out", Path(self.out))
        check_endpoint(self.s3_endpoint)
