"""How a daemon reads its datasets in object stores: one :class:`~shards.ranged.RemoteAccess`
built from the configuration (store options, counters, the node-local shard cache),
shared by every remote dataset, closed with the daemon."""

from __future__ import annotations

import logging

from feeder.config import ServerConfig
from shards.ranged import RemoteAccess
from shards.shard_cache import ShardCache
from shards.store import StoreCounters, StoreOptions

__all__ = ["close_remote", "remote_access"]

log = logging.getLogger(__name__)


def remote_access(config: ServerConfig) -> RemoteAccess | None:
    """The daemon's access to its remote datasets; None when all are local (a
    ``cache_dir`` is then not used, nor locked).

    Raises:
        ConfigError: the cache directory cannot be used, or another daemon holds it.
    """
    if not config.remote_datasets:
        if config.remote.cache_dir is not None:
            log.info("cache_dir %s is not used: every dataset is local", config.remote.cache_dir)
        return None
    cache = None
    if config.remote.cache_dir is not None:
        cache = ShardCache(config.remote.cache_dir, config.remote.cache_bytes,
                           fetch_bytes_per_s=config.remote.cache_fetch_bytes_per_s)
        usage = cache.usage()
        log.info("shard cache %s: %d shards, %.1f of %.1f GiB", config.remote.cache_dir, usage.cached_shards,
                 usage.cached_bytes / (1 << 30), usage.budget_bytes / (1 << 30))
    options = StoreOptions(endpoint_url=config.remote.s3_endpoint, retry_window_s=config.remote.store_retry_window_s)
    return RemoteAccess(options, StoreCounters(), cache, config.remote.store_requests,
                        heal_s=config.remote.store_heal_s)


def close_remote(remote: RemoteAccess | None) -> None:
    """End the waits of retries and heal windows, stop the cache's downloads and
    release its directory."""
    if remote is None:
        return
    remote.stopping.set()
    if remote.cache is not None:
        remote.cache.close()
