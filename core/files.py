"""Files named by options (a token, a certificate, a key): read whole, a failure one
``ConfigError`` line naming the option and the path."""

from __future__ import annotations

from pathlib import Path

from core.errors import ConfigError

__all__ = ["read_option_file"]


def read_option_file(option: str, path: str | Path) -> bytes:
    """The bytes of ``path``, given as ``option``.

    Raises:
        ConfigError: it cannot be read (``"tls_key: cannot read /etc/k (No such file or directory)"``).
    """
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path} ({e.strerror})") from e
