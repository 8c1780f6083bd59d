"""SRC as an object store prefix (``s3://bucket/imagenet``, ``gs://``, ``az://``),
listed and read with the project's store client (``shards.store``: timeouts, retries
of transient failures, one line naming the URL when the store refuses).

The prefix holds either layout a folder would:

- a folder tree (``train/<wnid>/*.JPEG``, ``val/`` with its ground truth, a Kaggle
  download, any class-folder tree): one LIST of the prefix, then each image one GET;
- the image-net.org tars (``ILSVRC2012_img_train.tar`` ...,
  ``sharder.download_tars``): their headers read with small ranged GETs, each image
  then one ranged GET at its offset.

Either way the sources, labels and order are those of the same tree on a local disk,
so the shards are byte-identical to sharding a local copy with the same seed.
"""

from __future__ import annotations

from core.errors import NotFound
from sharder.download_tars import TRAIN_TAR, VAL_TAR, find_download_sources
from sharder.names_tree import Listed, data_folder, metadata_folders, names_lookup, tree_of_names
from sharder.source_reads import FileSource, StoreFiles
from sharder.source_tree import SourceTree, checked
from shards.objects import ObjectUrl
from shards.store import StoreOptions

__all__ = ["find_store_sources"]


def find_store_sources(url: str, on_error: str, options: StoreOptions) -> SourceTree:
    """The layout, classes and samples under the store prefix ``url``.

    Raises:
        NotFound: the bucket does not exist, or nothing is under the prefix.
        ConfigError, DataError: as for a local SRC (``sharder.sources.find_sources``).
        StoreRefused, StoreForbidden, StoreUnreachable: the store cannot be listed.
    """
    files = StoreFiles(str(ObjectUrl.parse(url)), options)
    names = sorted(files.store.listing())
    if not names:
        raise NotFound(f"SRC {files.url} holds no objects")
    held = set(names)
    if (TRAIN_TAR in held or VAL_TAR in held) and not any(name.startswith("train/") for name in names):
        return find_download_sources(files, held, on_error)
    data = data_folder(names)
    lookup = names_lookup(files, held, metadata_folders(data))
    return checked(tree_of_names(Listed(files.url, names, FileSource(files), lookup), data))
