"""The ``ffcv`` loader's own logic: where its dataset file goes, what it is written from,
the epochs it walks, and its skip outside its venv. The dataset file itself is written
only where the bench has made ``.bench/venv-ffcv`` (the test suite never makes it)."""

from __future__ import annotations

import importlib.util
import io
import subprocess
import tempfile
from pathlib import Path

import pytest
from PIL import Image

from bench.loaders import LoaderSpec, LoaderUnavailable, ffcv_beton
from bench.loaders.tar_samples import read_samples
from bench.throughput import DEFAULT_CACHE, REPO
from bench.venvs import is_made

needs_no_ffcv = pytest.mark.skipif(importlib.util.find_spec("ffcv") is not None, reason="ffcv is installed here")


def _spec(shards: Path, cache: Path | None, split: str = "train") -> LoaderSpec:
    return LoaderSpec(shards=shards, source=None, split=split, batch_size=8, image_size_px=32, cache=cache)


def test_the_dataset_file_is_named_by_the_shards_and_the_split(bench_shards: Path, tmp_path: Path) -> None:
    path = ffcv_beton.beton_path(_spec(bench_shards, tmp_path))

    assert path == ffcv_beton.beton_path(_spec(bench_shards, tmp_path))
    assert path.parent == tmp_path / "ffcv" and path.name.startswith("train-") and path.suffix == ".beton"
    assert ffcv_beton.beton_path(_spec(bench_shards, tmp_path, "val")) != path
    assert ffcv_beton.beton_path(_spec(bench_shards, None)).is_relative_to(tempfile.gettempdir())
    with pytest.raises(FileNotFoundError, match="feeder shard"):
        ffcv_beton.beton_path(_spec(tmp_path, tmp_path))


def test_the_writer_is_given_each_stored_jpeg_decoded_to_rgb_with_its_label(bench_shards: Path) -> None:
    samples = read_samples(bench_shards, "train", 100)
    dataset = ffcv_beton.DecodedSamples(samples)

    assert len(dataset) == len(samples)
    for index in (0, len(samples) - 1):
        image, label = dataset[index]
        stored = Image.open(io.BytesIO(samples[index].jpeg))
        assert image.mode == "RGB" and image.size == stored.size
        assert label == samples[index].label


def test_an_epoch_repeats_small_data_to_a_hundred_batches_and_leaves_large_data_alone() -> None:
    small = ffcv_beton.epoch_indices(64, 8)
    large = ffcv_beton.epoch_indices(20_000, 64)

    assert len(small) >= 100 * 8 and len(small) % 64 == 0
    assert {small.count(i) for i in range(64)} == {len(small) // 64}
    assert large == list(range(20_000))
    with pytest.raises(ValueError):
        ffcv_beton.epoch_indices(0, 8)


@needs_no_ffcv
def test_outside_its_venv_the_loader_is_skipped_with_one_line(bench_shards: Path, tmp_path: Path) -> None:
    spec = _spec(bench_shards, tmp_path)
    with pytest.raises(LoaderUnavailable) as preparing:
        ffcv_beton.prepare(spec)
    with pytest.raises(LoaderUnavailable) as opening, ffcv_beton.open_loader(spec):
        pass

    for caught in (preparing, opening):
        assert "ffcv cannot be imported here" in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.slow
def test_the_dataset_file_holds_every_sample_and_is_written_once(bench_shards: Path, tmp_path: Path) -> None:
    if not is_made(ffcv_beton.ENVIRONMENT, DEFAULT_CACHE):
        pytest.skip(f"{DEFAULT_CACHE / 'venv-ffcv'} is not made (bench/throughput.py --loaders ffcv makes it)")
    python = DEFAULT_CACHE / "venv-ffcv" / "bin" / "python"
    code = (
        "import sys; from pathlib import Path; from bench.loaders import LoaderSpec, ffcv_beton; "
        "from ffcv.reader import Reader; "
        f"spec = LoaderSpec(shards=Path({str(bench_shards)!r}), source=None, threads=1, "
        f"cache=Path({str(tmp_path)!r})); "
        "ffcv_beton.prepare(spec); print(Reader(str(ffcv_beton.beton_path(spec))).num_samples)"
    )

    written = subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    path = ffcv_beton.beton_path(_spec(bench_shards, tmp_path))
    modified = path.stat().st_mtime_ns
    subprocess.run([str(python), "-c", code], cwd=REPO, capture_output=True, text=True, check=True)

    assert int(written.stdout.split()[-1]) == len(read_samples(bench_shards, "train", 10_000))
    assert path.stat().st_mtime_ns == modified  # made once
    assert not list(path.parent.glob("*.partial"))
