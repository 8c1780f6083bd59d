"""What a daemon (or a tool) reads remote roots with: the store's options, the
counters its datasets share, the node cache, and what the cache knows each shard by.
The reads themselves are :mod:`shards.ranged`'s."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from shards.manifest import SplitEntry
from shards.objects import ObjectUrl
from shards.shard_cache import CachedShard, ShardCache
from shards.store import StoreCounters, StoreOptions

__all__ = ["RemoteAccess", "cache_entries"]


@dataclass(frozen=True)
class RemoteAccess:
    """How a daemon (or a tool) reads remote roots: the store's options, counters
    shared by its datasets, the node-local cache (None: ranged reads only), the
    requests in flight per dataset, and how long a shard the store fails is read
    again before its samples count as bad (:mod:`shards.troubles`)."""

    options: StoreOptions = StoreOptions()
    counters: StoreCounters = field(default_factory=StoreCounters)
    cache: ShardCache | None = None
    max_requests: int = 16
    heal_s: float = 0.0  # a tool's one look reports what it finds; the daemon waits (--store-heal-s)
    stopping: threading.Event = field(default_factory=threading.Event)  # set at shutdown: no more waits


def cache_entries(url: ObjectUrl, info: SplitEntry, shards: list[str],
                  checked: bool = True) -> list[CachedShard | None]:
    """Per tar of ``shards``, what the cache knows it by: its sha256 and size from
    the split's manifest entry ``info`` (None for a tar the split does not list, or
    with a sha256 that is not 64 hex digits long);
    ``checked``: the split's index has per-sample checksums."""
    listed = {s.path: s for s in info.shards}
    found: list[CachedShard | None] = []
    for shard in shards:
        entry = listed.get(shard)
        if entry is not None and len(entry.sha256) == 64:
            found.append(CachedShard(entry.sha256, entry.bytes, str(url / shard), checked))
        else:
            found.append(None)
    return found
