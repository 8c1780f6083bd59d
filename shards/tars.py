"""A tar open for serving: its descriptor, the identity of the file it was opened as,
and reads that tell the page cache from the disk."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

__all__ = ["OpenTar"]


class OpenTar:
    """An open tar: its descriptor and the identity of the file it was opened as.

    Raises:
        OSError: the file cannot be opened.
    """

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_RDONLY)
        stat = os.fstat(self.fd)
        self.identity = (stat.st_dev, stat.st_ino)
        # Reads first try RWF_NOWAIT (Linux): it reads only what is in the page cache,
        # which tells cached reads from disk reads. Off where the file system refuses it.
        self._nowait = getattr(os, "RWF_NOWAIT", 0)

    def read_into(self, buffer: np.ndarray, offset: int) -> tuple[int, bool]:
        """Bytes read into ``buffer`` from ``offset`` (fewer than its size at end of
        file), and whether all of them came from the page cache (False where that is
        unknown)."""
        done, cached = 0, bool(self._nowait)
        if self._nowait:
            try:
                done = os.preadv(self.fd, [buffer.data], offset, self._nowait)
            except BlockingIOError:  # not (all) in the page cache
                pass
            except OSError:  # the file system does not do RWF_NOWAIT
                self._nowait = 0
            cached = done == len(buffer)
        while done < len(buffer):
            count = os.preadv(self.fd, [buffer.data[done:]], offset + done)
            if count == 0:
                break
            done += count
        return done, cached

    def close(self) -> None:
        os.close(self.fd)
