"""``tfdata``: tf.data in this process, the strongest CPU peer (tensorflow-cpu,
optional: skipped with a one-line reason where it cannot be imported).

The same JPEG bytes as the other loaders (read from the shards into memory, so no
I/O is timed), shuffled; per sample ``tf.image.decode_and_crop_jpeg`` of a
RandomResizedCrop window drawn with torchvision's law (area uniform in [0.08, 1],
aspect ratio log-uniform in [3/4, 4/3], 10 tries, then the central crop), bilinear
resize without antialiasing (feeder's default filter), random flip, uint8 batches;
``map`` and ``prefetch`` with AUTOTUNE, TensorFlow's thread pools sized to the budget.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from bench.loaders.base import Batch, LoaderSpec, LoaderUnavailable
from shards.reader import ShardDataset

__all__ = ["open_loader"]

# Encoded samples held in memory (about 2 GB of ImageNet-sized JPEGs at most).
_MAX_SAMPLES = 20000
_TRIES = 10


def _import_tf() -> Any:
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")  # no start-up banner in the log
    try:
        import tensorflow as tf
    except ImportError as e:
        raise LoaderUnavailable(f"tensorflow is not installed ({e}); pip install tensorflow-cpu") from e
    return tf


def _crop_window(tf: Any, shape: Any) -> Any:
    """[y, x, h, w] of a RandomResizedCrop window of an image of ``shape`` (h, w, c)."""
    height, width = tf.cast(shape[0], tf.float32), tf.cast(shape[1], tf.float32)
    area = height * width * tf.random.uniform([_TRIES], 0.08, 1.0)
    aspect = tf.exp(tf.random.uniform([_TRIES], math.log(3 / 4), math.log(4 / 3)))
    w, h = tf.round(tf.sqrt(area * aspect)), tf.round(tf.sqrt(area / aspect))
    fits = (w > 0) & (h > 0) & (w <= width) & (h <= height)
    first = tf.argmax(tf.cast(fits, tf.int32))
    ratio = width / height
    fallback_w = tf.where(ratio > 4 / 3, tf.round(height * 4 / 3), width)
    fallback_h = tf.where(ratio < 3 / 4, tf.round(width * 4 / 3), height)
    found = tf.reduce_any(fits)
    cw = tf.where(found, w[first], fallback_w)
    ch = tf.where(found, h[first], fallback_h)
    u = tf.random.uniform([2])
    x = tf.where(found, tf.floor(u[0] * (width - cw + 1)), tf.floor((width - cw) / 2))
    y = tf.where(found, tf.floor(u[1] * (height - ch + 1)), tf.floor((height - ch) / 2))
    return tf.cast(tf.stack([y, x, ch, cw]), tf.int32)


def _dataset(tf: Any, jpegs: list[bytes], spec: LoaderSpec) -> Any:
    side = spec.image_size_px

    def augment(data: Any) -> Any:
        window = _crop_window(tf, tf.io.extract_jpeg_shape(data))
        image = tf.image.decode_and_crop_jpeg(data, window, channels=3)
        image = tf.image.resize(image, [side, side], method="bilinear", antialias=False)
        image = tf.image.random_flip_left_right(image)
        return tf.cast(tf.round(image), tf.uint8)

    options = tf.data.Options()
    options.threading.private_threadpool_size = spec.threads
    ds = tf.data.Dataset.from_tensor_slices(jpegs).shuffle(len(jpegs), seed=spec.seed).repeat()
    ds = ds.map(augment, num_parallel_calls=tf.data.AUTOTUNE, deterministic=False)
    return ds.batch(spec.batch_size, drop_remainder=True).prefetch(tf.data.AUTOTUNE).with_options(options)


@contextmanager
def open_loader(spec: LoaderSpec, shared: object = None) -> Iterator[Iterator[Batch]]:
    """Yields endless uint8 NHWC batches made by tf.data in this process.

    Raises:
        LoaderUnavailable: tensorflow cannot be imported.
        FeederError: ``spec.shards`` is not a shard directory with ``spec.split``.
    """
    tf = _import_tf()
    tf.config.threading.set_inter_op_parallelism_threads(spec.threads)
    tf.config.threading.set_intra_op_parallelism_threads(1)  # parallel over samples, as the others
    split = ShardDataset.open("bench", spec.shards).splits[spec.split]
    jpegs = [split.read(i).tobytes() for i in range(min(len(split), _MAX_SAMPLES))]
    dataset = _dataset(tf, jpegs, spec)
    yield (Batch(int(b.shape[0]), b, "NHWC", "uint8") for b in (t.numpy() for t in dataset))
