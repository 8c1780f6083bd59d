"""What a store said about the shards of one remote split, kept as a state of the
store, not of the samples: an object missing, or whose bytes differ from the index,
is often an overwrite or a re-upload under way, and what was true of it a minute ago
says little about it now.

For each shard in trouble, :class:`ShardTroubles` keeps:

- a *heal window* (``heal_s`` from the first failure): reads that fail within it are
  tried again with backoff (:meth:`ShardTroubles.wait_s`) before their samples go to
  the bad-sample policy; once it has passed, the shard's failures are answered at
  once, so a shard really gone costs one window, not one per batch;
- what the store showed of it when it failed (that it was missing, or its ETag, asked
  for at once), looked at again in the background at most every ``recheck_s``
  (:meth:`ShardTroubles.looked`). The trouble is over, and the listeners told (the
  split's bad samples are forgotten and tried again), when the object shows another
  ETag, a read of it succeeds after it was missing, or ``ttl_s`` has passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

__all__ = ["ShardTroubles"]

_log = logging.getLogger(__name__)
_TTL_S = 300.0  # what a store said of a shard is forgotten after this long, whatever it shows
_FIRST_DELAY_S, _MAX_DELAY_S = 0.1, 1.0  # backoff of reads within the window, doubling
_MISSING = ""  # what a look found for an object that is not there


@dataclass
class _Trouble:
    since_s: float
    missing: bool  # the object was missing (else its bytes differed from the index)
    delay_s: float = _FIRST_DELAY_S
    seen: str | None = None  # what the store showed when it failed ("" missing; None: not known yet)
    looked_s: float = 0.0
    look: Future[str] | None = field(default=None, repr=False)


class ShardTroubles:
    """The shards of one split a store failed (thread-safe).

    Args:
        heal_s: how long a failing shard is read again before its failures count.
        recheck_s: the most time between two looks at a shard in trouble.
        look: starts a look at shard ``n``: a future of its ETag ("" when missing).
        name: shard ``n``'s name relative to the split's root, for the listeners.
        url: shard ``n``'s URL, for the log.
        ttl_s: the longest a trouble is remembered.
    """

    def __init__(self, heal_s: float, recheck_s: float, look: Callable[[int], Future[str]],
                 name: Callable[[int], str], url: Callable[[int], str], ttl_s: float = _TTL_S) -> None:
        self._heal_s, self._recheck_s, self._ttl_s = heal_s, recheck_s, ttl_s
        self._look, self._name, self._url = look, name, url
        self._troubles: dict[int, _Trouble] = {}
        self._generations: dict[int, int] = {}
        self._listeners: list[Callable[[str], None]] = []
        self._lock = threading.Lock()

    def wait_s(self, shard: int, missing: bool) -> float:
        """How long to wait before reading ``shard`` again after a failure (0: its
        heal window has passed: the failure stands). The first failure starts it.

        Args:
            missing: the store said the object is missing (else: its bytes differed
                from the index, or it was shorter than the index says).
        """
        now = time.monotonic()
        with self._lock:
            trouble = self._troubles.get(shard)
            if trouble is None:
                # What the store shows now is what a later look must find changed: known
                # for a missing object, asked for at once for one whose bytes differ.
                trouble = self._troubles[shard] = _Trouble(now, missing, seen=_MISSING if missing else None,
                                                            looked_s=now)
                if not missing:
                    trouble.look = self._look(shard)
                what = "missing" if missing else "its bytes differ from the index"
                _log.warning("%s: %s; read again for up to %g s before its samples count as bad", self._url(shard),
                             what, self._heal_s)
            left = trouble.since_s + self._heal_s - now
            if left <= 0:
                return 0.0
            wait_s, trouble.delay_s = min(trouble.delay_s, left), min(trouble.delay_s * 2, _MAX_DELAY_S)
        return wait_s

    def read_ok(self, shard: int) -> None:
        """A read of ``shard`` succeeded: a trouble of a missing object is over (one of
        bytes that differ is not: the shard's other samples may well be right)."""
        with self._lock:
            trouble = self._troubles.get(shard)
            over = trouble is not None and trouble.missing
        if over:
            self._over(shard, "it is read again")

    def looked(self, shard: int) -> None:
        """Look at ``shard`` if it is in trouble and ``recheck_s`` has passed since the
        last look; the trouble ends when what the store shows changed (or at its time
        to live). Never waits for the store."""
        now = time.monotonic()
        with self._lock:
            trouble = self._troubles.get(shard)
            if trouble is None or now < trouble.since_s + self._heal_s:
                return
            if now > trouble.since_s + self._ttl_s:
                ended = "its time to live passed"
            else:
                ended = self._read_look(trouble, now, shard)
        if ended:
            self._over(shard, ended)

    def _read_look(self, trouble: _Trouble, now: float, shard: int) -> str:
        """What the last look found, if it is done; a new one started when due."""
        look = trouble.look
        if look is not None and look.done():
            trouble.look = None
            shown = look.result() if look.exception() is None else None
            if shown is not None:
                if trouble.seen is None:
                    trouble.seen = shown
                elif shown != trouble.seen:
                    return "it exists again" if trouble.seen == _MISSING else "its ETag changed"
        if trouble.look is None and now - trouble.looked_s >= self._recheck_s:
            trouble.looked_s, trouble.look = now, self._look(shard)
        return ""

    def _over(self, shard: int, why: str) -> None:
        with self._lock:
            if self._troubles.pop(shard, None) is None:
                return
            self._generations[shard] = self._generations.get(shard, 0) + 1
            listeners = list(self._listeners)
        _log.info("%s: %s; its samples are read again", self._url(shard), why)
        for listener in listeners:
            listener(self._name(shard))

    def generation(self, shard: int) -> int:
        """How many troubles of ``shard`` are over."""
        with self._lock:
            return self._generations.get(shard, 0)

    def on_over(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(shard name)`` when a trouble of a shard is over."""
        with self._lock:
            self._listeners.append(listener)
