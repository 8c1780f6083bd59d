"""Opening a dataset's files beneath its root, whatever links its directory holds.

A shard directory may be writable by people the daemon does not trust as much as its
own operator: a tar (or ``train/`` itself) made a symbolic link to ``/etc/shadow``
would make the daemon read, and serve in pixels and checksums, any file it can. Every
shard is therefore opened with the path resolved beneath the root's real path: with
``openat2(RESOLVE_BENEATH)`` where the kernel has it (Linux 5.6), else by resolving the
real path first, checking it, and opening it with ``O_NOFOLLOW``. A link that stays
inside the root is fine. Spreading shards over disks with links is a common layout,
so links into directories the operator names (``--allow-shard-links DIR``) are
allowed too; any other link is refused with :class:`LinkOutside`.
"""

from __future__ import annotations

import ctypes
import errno
import os
import platform
from collections.abc import Sequence
from pathlib import Path

__all__ = ["LinkOutside", "open_beneath"]

# openat2(2): the syscall number (the same on x86_64 and aarch64; 0: not known here),
# its resolve flags.
_SYS_OPENAT2 = {"x86_64": 437, "aarch64": 437}.get(platform.machine(), 0)
_RESOLVE_NO_MAGICLINKS, _RESOLVE_BENEATH = 0x02, 0x08
_FLAGS = os.O_RDONLY | os.O_CLOEXEC


class LinkOutside(OSError):
    """A path under a dataset's root that leads outside it (an ``OSError`` of errno
    ``EXDEV``: whoever keeps a file open on a changed path keeps the old one)."""

    def __init__(self, path: Path, root: Path, target: str) -> None:
        super().__init__(errno.EXDEV, f"leads outside the dataset's directory {root} (to {target}); serve it with "
                                      "--allow-shard-links DIR if that directory is meant")
        self.filename = str(path)


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long
_have_openat2 = _SYS_OPENAT2 != 0 and os.uname().sysname == "Linux"


def open_beneath(root: Path, relative: str, allowed: Sequence[Path] = ()) -> int:
    """A read-only descriptor of ``root / relative``, resolved beneath ``root``'s real
    path (or inside one of ``allowed``, for a link that leaves it).

    Raises:
        LinkOutside: the path leads outside ``root`` and every ``allowed`` directory.
        OSError: it cannot be opened (missing, a loop of links, no permission).
    """
    global _have_openat2
    real_root = Path(os.path.realpath(root))
    if _have_openat2:
        try:
            return _openat2(real_root, relative)
        except OSError as e:
            if e.errno in (errno.ENOSYS, errno.EPERM):  # an older kernel, or a seccomp filter refusing it
                _have_openat2 = False
            elif e.errno != errno.EXDEV:
                raise
    return _open_checked(root, real_root, relative, allowed)


def _openat2(real_root: Path, relative: str) -> int:
    directory = os.open(real_root, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        how = _OpenHow(_FLAGS, 0, _RESOLVE_BENEATH | _RESOLVE_NO_MAGICLINKS)
        fd = _libc.syscall(ctypes.c_long(_SYS_OPENAT2), ctypes.c_int(directory), os.fsencode(relative),
                           ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how)))
    finally:
        os.close(directory)
    if fd < 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), str(real_root / relative))
    return int(fd)


def _open_checked(root: Path, real_root: Path, relative: str, allowed: Sequence[Path]) -> int:
    """Resolve the real path, check it, open it without following a link at its end."""
    target = os.path.realpath(real_root / relative)
    homes = [real_root, *(Path(os.path.realpath(a)) for a in allowed)]
    if not any(Path(target).is_relative_to(home) for home in homes):
        raise LinkOutside(root / relative, root, target)
    return os.open(target, _FLAGS | os.O_NOFOLLOW)
