"""gRPC payload messages larger than glibc's dynamic mmap limit.

glibc's malloc serves a block above its mmap threshold from fresh pages (``mmap``)
and gives them back on ``free``. The threshold follows the largest block freed, up
to 32 MiB on 64-bit systems, and stops there. A 224 px batch of 256 images is a
38.5 MB message: above the limit, so on both sides of the socket every message is
faulted in and zero-filled anew (the daemon's message, gRPC's received bytes on the
client). Measured with ``bench/transport_only.py`` on 2 cores, batch 256: 0.85 GB/s
as glibc sets it, 2.16 GB/s with the threshold raised in both processes; raised in
only one of them, the other limits (0.9 GB/s). Batches of 64 (9.6 MB) are under the
limit: glibc keeps them on its heap by itself.

:func:`fit_messages` raises this process's threshold once, the first time a gRPC
payload message above the limit is sent or received here: ``M_MMAP_THRESHOLD``
128 MiB and ``M_TRIM_THRESHOLD`` 256 MiB (the heap then keeps up to 256 MiB freed
for reuse, and the threshold no longer moves by itself), with one log line. It
leaves malloc alone where the process's environment sets either (``MALLOC_*_`` or
``GLIBC_TUNABLES``: the user's own choice), without glibc, and for smaller messages.
"""

from __future__ import annotations

import ctypes
import logging
import os
import threading

__all__ = ["DYNAMIC_LIMIT_BYTES", "MMAP_THRESHOLD_BYTES", "TRIM_THRESHOLD_BYTES", "fit_messages"]

_log = logging.getLogger(__name__)

DYNAMIC_LIMIT_BYTES = 32 << 20  # DEFAULT_MMAP_THRESHOLD_MAX on 64-bit glibc
MMAP_THRESHOLD_BYTES = 128 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")

_lock = threading.Lock()
_decided = False


def _mallopt() -> ctypes._NamedFuncPointer | None:
    try:
        return ctypes.CDLL("libc.so.6").mallopt
    except (OSError, AttributeError):  # not glibc
        return None


def fit_messages(nbytes: int) -> bool:
    """Keep messages of ``nbytes`` on malloc's heap in this process (see the module
    doc). Returns True the one time it changes malloc's settings."""
    global _decided
    if nbytes <= DYNAMIC_LIMIT_BYTES or _decided:
        return False
    with _lock:
        if _decided:
            return False
        _decided = True
        set_by_user = [name for name in _USER_SETTINGS if name in os.environ]
        if set_by_user:
            _log.info("gRPC messages of %d bytes: malloc left as %s sets it", nbytes, set_by_user[0])
            return False
        mallopt = _mallopt()
        if mallopt is None or not (mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                                   and mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)):
            return False
        _log.info(
            "gRPC messages of %d bytes, over glibc's %d MiB mmap limit: this process keeps blocks up to %d MiB "
            "on malloc's heap and up to %d MiB freed for reuse (set MALLOC_MMAP_THRESHOLD_ to choose otherwise)",
            nbytes, DYNAMIC_LIMIT_BYTES >> 20, MMAP_THRESHOLD_BYTES >> 20, TRIM_THRESHOLD_BYTES >> 20,
        )
        return True
