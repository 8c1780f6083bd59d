"""``RunConfig``: the options of ``feeder run`` (:mod:`launcher.run`), ``feeder serve``'s
and the launcher's own. Light to import: the CLI builds it before anything starts."""

from __future__ import annotations

from dataclasses import dataclass

from core.errors import ConfigError
from feeder.config import ServerConfig

__all__ = ["RunConfig"]


@dataclass(frozen=True)
class RunConfig(ServerConfig):
    """``feeder serve``'s options, and how the launcher keeps its daemon.

    Args:
        start_timeout_s: seconds the daemon may take, from its start, to say SERVING
            (opening shards from a store takes longest); past them the launcher
            stops it and exits with status 1 without starting the command.
        restarts: how many times a daemon that dies while the command runs is
            started again (after 1, 2, 4 ... s, at most 30 s); 0: never.
        pool_with: more daemons serving the same datasets (other nodes'),
            ``HOST:PORT`` each, comma-separated: they follow this node's in
            ``FEEDER_ADDRESS``, so the command's loaders draw from them as a pool.
    """

    start_timeout_s: float = 120.0
    restarts: int = 5
    pool_with: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.start_timeout_s > 0:  # NaN too
            raise ConfigError(f"start_timeout_s: must be > 0, got {self.start_timeout_s}")
        if self.restarts < 0:
            raise ConfigError(f"restarts: must be >= 0, got {self.restarts}")
        if self.security.tls_cert is not None and self.socket_path is None:
            raise ConfigError("socket_path: a daemon serving TLS needs --socket-path too: the launcher and this "
                              "node's ranks reach it there")
        for address in self.pool_with:
            host, colon, port = address.rpartition(":")
            if not (host and colon and port.isdigit()):
                raise ConfigError(f"pool_with: {address!r} is not HOST:PORT")
