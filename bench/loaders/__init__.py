"""The loaders ``bench/throughput.py`` compares, by name.

Each module offers ``open_loader(spec, shared)``; loaders that several consumers share
(a daemon) also offer ``open_shared(spec)``, run once before the consumers start. A
module may also offer ``prepare(spec)``, run once in a process of its own before the
loader's first start (writing a dataset file in the loader's own format: neither its
time nor its memory is the loader's), and ``ENVIRONMENT``, a ``bench.venvs.Environment``
whose interpreter its worker (and ``prepare``) runs in; such a module imports nothing but
the standard library at its top, so the bench can read these in its own interpreter.
"""

from __future__ import annotations

from importlib import import_module
from types import ModuleType

from bench.loaders.base import Batch, LoaderSpec, LoaderUnavailable, check_batch

__all__ = [
    "LOADERS", "MULTI_CLIENT", "STORE_LOADERS", "Batch", "LoaderSpec", "LoaderUnavailable", "check_batch",
    "loader_module",
]

# Name on the command line -> module under bench.loaders, in the order they run.
LOADERS = {
    "feeder-shm": "feeder_shm",
    "feeder-cuda-ipc": "feeder_cuda_ipc",
    "feeder-grpc": "feeder_grpc",
    "inprocess": "inprocess",
    "tfdata": "tfdata",
    "ffcv": "ffcv_beton",
    "spdl": "spdl_pipeline",
    "torchvision": "imagefolder",
    "webdataset": "webdataset_tars",
    "decode-only": "decode_only",
    "synthetic": "synthetic",
    "feeder-s3": "feeder_s3",
    "streaming": "streaming_mds",
    "webdataset-s3": "webdataset_s3",
    "litdata": "litdata_chunks",
}
# Loaders that read from the object store of ``throughput.py --store s3`` (only there).
STORE_LOADERS = ("feeder-s3", "streaming", "webdataset-s3", "litdata")
# Loaders that serve several concurrent consumers (--clients).
MULTI_CLIENT = ("feeder-shm", "feeder-cuda-ipc", "feeder-grpc", "feeder-s3")


# Top-level packages of this repository: a module of theirs missing is a bug, not a
# loader's package that this install lacks.
_OWN = ("bench", "clients", "core", "feeder", "protocol", "protos", "sharder", "shards", "trainer", "transport")


def loader_module(name: str) -> ModuleType:
    """The module implementing loader ``name``.

    Raises:
        KeyError: ``name`` is not in ``LOADERS``.
        LoaderUnavailable: a package it imports is not installed (one line naming it),
            as after ``pip install .`` without the bench's extras.
    """
    try:
        return import_module(f"bench.loaders.{LOADERS[name]}")
    except ModuleNotFoundError as e:
        missing = (e.name or "").split(".")[0]
        if not missing or missing in _OWN:
            raise
        raise LoaderUnavailable(f"needs the package {missing!r}, which is not installed here "
                                "(pip install 'feeder[dev]' installs the bench's peers)") from e
