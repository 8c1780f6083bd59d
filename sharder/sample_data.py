"""``feeder sample-data``: a small real-photo ImageNet in the ILSVRC2012 layout.

ImageNet cannot ship, so the demo and the benchmarks use the photographs that come
inside the scikit-image and scikit-learn wheels: one class per photograph, each sample
a random crop / flip / colour jitter of it, re-encoded as JPEG at ImageNet-like sizes.
The tree looks like a Kaggle ILSVRC download::

    DIR/train/<wnid>/<wnid>_<n>.JPEG
    DIR/val/ILSVRC2012_val_<8 digits>.JPEG          (flat)
    DIR/LOC_val_solution.csv                         (ImageId,PredictionString)
    DIR/LOC_synset_mapping.txt                       (<wnid> <name>, sorted by wnid)
"""

from __future__ import annotations

import io
import os
import shutil
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import numpy as np
from PIL import Image
from tqdm import tqdm

from core.errors import ConfigError
from sharder.config import SampleDataConfig, progress_shown

__all__ = ["PHOTO_NAMES", "make_sample_data", "sample_wnid"]


def _skimage(name: str) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        import skimage.data

        image = getattr(skimage.data, name)()
        return image[0] if isinstance(image, tuple) else image  # stereo pairs: left view

    return load


def _sklearn(index: int) -> Callable[[], np.ndarray]:
    def load() -> np.ndarray:
        from sklearn.datasets import load_sample_images

        return load_sample_images().images[index]

    return load


# Colour photographs first (the default 10 classes), then grayscale ones.
_PHOTOS: dict[str, Callable[[], np.ndarray]] = {
    "astronaut": _skimage("astronaut"),
    "cat": _skimage("chelsea"),
    "coffee": _skimage("coffee"),
    "rocket": _skimage("rocket"),
    "motorcycle": _skimage("stereo_motorcycle"),
    "palace": _sklearn(0),
    "flower": _sklearn(1),
    "galaxies": _skimage("hubble_deep_field"),
    "tissue": _skimage("immunohistochemistry"),
    "retina": _skimage("retina"),
    "cameraman": _skimage("camera"),
    "coins": _skimage("coins"),
    "moon": _skimage("moon"),
    "brick": _skimage("brick"),
    "grass": _skimage("grass"),
    "gravel": _skimage("gravel"),
    "clock": _skimage("clock"),
}
PHOTO_NAMES = tuple(_PHOTOS)


def sample_wnid(class_index: int) -> str:
    """The made-up WordNet id of sample class ``class_index`` (``n00000001``, ...)."""
    return f"n{class_index + 1:08d}"


def _variant(photo: Image.Image, rng: np.random.Generator, config: SampleDataConfig) -> tuple[bytes, int, int]:
    """One augmented JPEG of ``photo``; returns (bytes, width, height)."""
    width, height = photo.size
    out_w, out_h = (int(side) for side in rng.integers(config.min_side_px, config.max_side_px + 1, size=2))
    size = (out_w, out_h)
    aspect = out_w / out_h
    area = rng.uniform(0.3, 1.0) * width * height  # crop covers 30..100 % of the photo
    crop_w = int(min(width, max(16, (area * aspect) ** 0.5)))
    crop_h = int(min(height, max(16, crop_w / aspect)))
    left, top = int(rng.integers(0, width - crop_w + 1)), int(rng.integers(0, height - crop_h + 1))
    image = photo.crop((left, top, left + crop_w, top + crop_h))
    if rng.random() < 0.5:
        image = image.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    image = image.resize(size, Image.Resampling.BILINEAR)
    pixels = np.asarray(image, dtype=np.float32)
    gain = rng.uniform(0.9, 1.1, size=(3,) if pixels.ndim == 3 else ()) * rng.uniform(0.9, 1.1)
    pixels = np.clip(pixels * gain, 0, 255).astype(np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="JPEG", quality=int(rng.integers(85, 96)))
    return buffer.getvalue(), size[0], size[1]


def _write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)


def _load_photo(name: str) -> Image.Image:
    array = _PHOTOS[name]()
    return Image.fromarray(array if array.ndim == 2 else array[..., :3])


def make_sample_data(config: SampleDataConfig) -> Path:
    """Write the sample tree described in the module docstring.

    Args:
        config: what to make; the same config gives byte-identical files.

    Returns:
        ``config.out``.

    Raises:
        ConfigError: more classes than photographs, a non-empty or unwritable ``config.out``.
    """
    if config.classes > len(_PHOTOS):
        raise ConfigError(f"--classes can be at most {len(_PHOTOS)} (one per bundled photograph), got {config.classes}")
    if config.out.exists() and any(config.out.iterdir()):
        raise ConfigError(f"{config.out} is not empty")
    # Built beside OUT and renamed at the end: an interrupted run leaves no half tree.
    partial = config.out.with_name(config.out.name + ".partial")
    try:
        shutil.rmtree(partial, ignore_errors=True)
        _build(replace(config, out=partial))
        os.replace(partial, config.out)
    except OSError as e:
        raise ConfigError(f"cannot write the sample data to {config.out}: {e.strerror or e}") from e
    return config.out


def _build(config: SampleDataConfig) -> None:
    rng = np.random.default_rng(config.seed)
    names = PHOTO_NAMES[: config.classes]
    val_labels: list[int] = []
    total = config.classes * (config.train_per_class + config.val_per_class)
    with tqdm(total=total, unit="img", desc="sample-data", disable=not progress_shown(config.progress)) as bar:
        for index, name in enumerate(names):
            photo, wnid = _load_photo(name), sample_wnid(index)
            for n in range(1, config.train_per_class + 1):
                _write(config.out / "train" / wnid / f"{wnid}_{n}.JPEG", _variant(photo, rng, config)[0])
                bar.update(1)
            val_labels += [index] * config.val_per_class
        _write_val(config, names, rng.permutation(np.array(val_labels, dtype=np.int64)), rng, bar)
    mapping = "".join(f"{sample_wnid(i)} {name}\n" for i, name in enumerate(names))
    _write(config.out / "LOC_synset_mapping.txt", mapping.encode())


def _write_val(
    config: SampleDataConfig, names: tuple[str, ...], labels: np.ndarray, rng: np.random.Generator, bar: tqdm
) -> None:
    """Flat val/ in Kaggle form: images numbered from 1, labels in LOC_val_solution.csv."""
    photos = {int(label): _load_photo(names[int(label)]) for label in set(labels.tolist())}
    rows = ["ImageId,PredictionString"]
    (config.out / "val").mkdir(parents=True, exist_ok=True)
    for number, label in enumerate(labels.tolist(), start=1):
        image_id = f"ILSVRC2012_val_{number:08d}"
        data, width, height = _variant(photos[label], rng, config)
        _write(config.out / "val" / f"{image_id}.JPEG", data)
        bar.update(1)
        rows.append(f"{image_id},{sample_wnid(label)} 0 0 {width - 1} {height - 1}")
    _write(config.out / "LOC_val_solution.csv", ("\n".join(rows) + "\n").encode())
