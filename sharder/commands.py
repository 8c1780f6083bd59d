"""The sharder's commands: ``feeder sample-data``, ``feeder shard``, ``feeder verify``."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from core.bad_input import DEFAULT_MAX_PIXELS
from core.cli import run_command
from sharder.config import DEFAULT_RESTART_INTERVAL

__all__ = ["register"]

_MB = 1024 * 1024


def sample_data_command(
    ctx: typer.Context,
    out: Annotated[Path, typer.Argument(help="Directory to create, e.g. data/sample.")],
    classes: Annotated[int, typer.Option(help="Classes, one per bundled photograph.")] = 10,
    train_per_class: Annotated[int, typer.Option(help="Training images per class.")] = 100,
    val_per_class: Annotated[int, typer.Option(help="Validation images per class.")] = 10,
    seed: Annotated[int, typer.Option(help="Same seed, byte-identical files.")] = 0,
    progress: Annotated[bool | None, typer.Option(help="Show a progress bar (default: when stderr is a terminal).")] = None,
) -> None:
    """Make a small real-photo ImageNet in the ILSVRC2012 layout.

    Example: feeder sample-data data/sample --classes 10 --train-per-class 100
    """
    from sharder import SampleDataConfig, make_sample_data

    def run() -> None:
        config = SampleDataConfig(
            out, classes=classes, train_per_class=train_per_class, val_per_class=val_per_class, seed=seed, progress=progress
        )
        make_sample_data(config)
        total = classes * (train_per_class + val_per_class)
        print(f"wrote {total} images of {classes} classes ({classes * train_per_class} train, {classes * val_per_class} val) -> {out}")

    run_command(ctx, run)


def shard_command(
    ctx: typer.Context,
    src: Annotated[Path, typer.Argument(help="Input tree: ILSVRC2012 layout (train/, val/) or class folders.")],
    out: Annotated[Path, typer.Argument(help="Shard directory to create (or to resume into).")],
    format_list: Annotated[str, typer.Option("--format", help="Comma list of wds, lmdb.")] = "wds",
    seed: Annotated[int, typer.Option(help="Seed of the global shuffle.")] = 0,
    shard_size_mb: Annotated[float, typer.Option(help="Largest tar size in MiB.")] = 256,
    workers: Annotated[int, typer.Option(help="Processes that decode images (--check decode, odd formats, --max-side, --quality).")] = 1,
    max_side: Annotated[int | None, typer.Option(help="Downscale images whose longer side exceeds N px.")] = None,
    check: Annotated[str, typer.Option(help="decode: entropy-decode every image before accepting it (the restart-marker rewrite reads every coefficient; with --restart-interval 0, a full decode), rejecting it on any decoder warning; header: check JPEG headers and end marker only (faster, lets corrupt image data through).")] = "decode",
    max_pixels: Annotated[int, typer.Option(help="Reject images with more pixels, before decoding them (decompression bombs), or downscale them with --max-side. Default: Pillow's own bomb threshold, about 9459x9459, far above camera photos.")] = DEFAULT_MAX_PIXELS,
    quality: Annotated[int | None, typer.Option(help="Re-encode every image at this JPEG quality.")] = None,
    restart_interval: Annotated[int, typer.Option(help="Rewrite every JPEG losslessly (same pixels) with a restart marker about every N MCUs, so a crop window decodes only about its own area (1.5 % larger files at 2); 0 stores JPEGs as they come, byte for byte.")] = DEFAULT_RESTART_INTERVAL,
    half_copies: Annotated[bool, typer.Option(help="Also store each image at half scale (<key>.half.jpg, about a third more bytes): crop windows at least twice the output, as in the 128 px phases of progressive resizing, decode from it at a quarter of the work.")] = False,
    on_error: Annotated[str, typer.Option(help="skip: record bad inputs and go on; fail: stop at the first (raise: the same, deprecated).")] = "skip",
    overwrite: Annotated[bool, typer.Option(help="Replace the contents of a non-empty OUT.")] = False,
    progress: Annotated[bool | None, typer.Option(help="Show a progress bar (default: when stderr is a terminal).")] = None,
) -> None:
    """Shard an image folder tree into WebDataset tars (+ DALI .idx), an index and a manifest.

    Example: feeder shard ~/ILSVRC/Data/CLS-LOC out/imagenet --format wds,lmdb --workers 8
    """
    from sharder import ShardConfig, shard

    def run() -> None:
        formats = tuple(f.strip() for f in format_list.split(",") if f.strip())
        config = ShardConfig(
            src, out, formats=formats, seed=seed, shard_size_bytes=int(shard_size_mb * _MB), workers=workers,
            max_side_px=max_side, quality=quality, check=check, max_pixels=max_pixels,
            restart_interval=restart_interval, half_copies=half_copies, on_error=on_error,
            overwrite=overwrite, progress=progress,
        )  # fmt: skip
        try:
            print(shard(config).summary())
        except KeyboardInterrupt:
            print(f"feeder: interrupted; run the same command again to resume into {out}", file=sys.stderr)
            raise typer.Exit(130) from None

    run_command(ctx, run)


def verify_command(
    ctx: typer.Context,
    out: Annotated[Path, typer.Argument(help="Shard directory made by feeder shard.")],
    full: Annotated[bool, typer.Option(help="Decode every image, not a sample.")] = False,
    seed: Annotated[int, typer.Option(help="Seed choosing the decoded sample.")] = 0,
    progress: Annotated[bool | None, typer.Option(help="Show a progress bar (default: when stderr is a terminal).")] = None,
) -> None:
    """Check a shard directory: manifest, sha256, counts, index offsets, decodable images.

    Example: feeder verify out/imagenet --full
    """
    from sharder.verify import verify

    def run() -> None:
        result = verify(out, full=full, seed=seed, progress=progress)
        for problem in result.problems:
            print(f"problem: {problem}")
        print(result.summary())
        if result.problems:
            raise typer.Exit(1)

    run_command(ctx, run)


def register(app: typer.Typer) -> None:
    """Attach the sharder's commands to the ``feeder`` CLI."""
    app.command("sample-data")(sample_data_command)
    app.command("shard")(shard_command)
    app.command("verify")(verify_command)
