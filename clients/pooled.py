"""One stream of a rank's batches drawn from a pool of daemons (:mod:`clients.pool`),
with the interface of a single daemon's :class:`clients.fetcher.StreamFetcher`.

The stream's batches, numbered from its first across its epochs, are shared out by
the plan: with ``k`` daemons, batch ``g`` comes from the stream of share ``g mod k``
(``batch_stride`` ``k``, ``batch_offset`` ``g mod k`` in each request), so each
daemon's work is fixed and nothing is coordinated while they run. Batches are
handed out in order, whichever share they came from.

- A share whose daemon fails (its stream broke, or is being refused, or sent nothing
  for ``stall_timeout_s``) is taken over at once by another usable daemon, from the
  batch the rank needs next: a stream starting there with the same stride, so its
  numbering lines up. The failed daemon is probed in the background and used again
  once it answers.
- When the pool changes (a member back or added, or ``as-needed`` taking one more
  or one fewer), the shares are drawn afresh from the next batch: every stream is
  reopened there.
- ``as-needed`` starts on the first daemon and adds the next while the rank's wait
  for batches stays above 2 % of its time over a window, and drops one while it
  stays below 0.5 %.

Nothing is lost or delivered twice: every reopening starts at the rank's next batch.
"""

from __future__ import annotations

import logging
import threading
import time

from clients.fetcher import PENDING, StreamFetcher
from clients.host_batch import HostBatch
from clients.loader_config import LoaderConfig
from clients.pool import DaemonPool, Member
from clients.spec import StreamSpecs
from core.errors import ServiceUnavailable
from protos import feeder_pb2

__all__ = ["PooledFetcher", "WaitWindow"]

_log = logging.getLogger(__name__)
_POLL_S = 0.02  # how often get() looks at a failing or stalled share
_GROW_ABOVE, _SHRINK_BELOW = 0.02, 0.005  # share of the loop's time spent waiting (as-needed)
_WINDOW_S = 5.0  # over which that share is measured, and the least time between two changes


class WaitWindow:
    """The share of wall time a consumer spent waiting, over windows of ``_WINDOW_S``."""

    def __init__(self) -> None:
        self._started = time.monotonic()
        self._waited = 0.0
        self.last: float | None = None  # the last full window's share

    def add(self, waited_s: float) -> float | None:
        """Count ``waited_s``; the share of the window just completed, if one did."""
        self._waited += waited_s
        now = time.monotonic()
        if now - self._started < _WINDOW_S:
            return None
        self.last = self._waited / (now - self._started)
        self._started, self._waited = now, 0.0
        return self.last


class _Share:
    """One share of the stream: the daemon serving it and its fetcher."""

    def __init__(self, member: Member, fetcher: StreamFetcher) -> None:
        self.member, self.fetcher = member, fetcher


class PooledFetcher:
    """The batches of ``request`` (as one daemon would stream them), from ``pool``.

    Args:
        pool: the daemons.
        request: what one daemon alone would be asked for.
        specs: the loader's stream specs (the part's length per epoch).
        config: prefetch depth, timeouts, pool mode.
        pin: put host batches in pinned memory.
    """

    def __init__(self, pool: DaemonPool, request: feeder_pb2.StreamRequest, specs: StreamSpecs,
                 config: LoaderConfig, pin: bool) -> None:
        self.request = request
        self._pool, self._specs, self._config, self._pin = pool, specs, config, pin
        self.epoch, self.cursor = request.epoch, request.start_cursor  # where the next batch starts
        self.end_epoch = request.epoch + max(1, request.epochs)
        self.finished = threading.Event()
        self.reconnects = 0
        self._wait = WaitWindow()
        self._changed_s = time.monotonic()
        wanted = 1 if config.pool == "as-needed" else len(pool.usable())
        self._shares: list[_Share] = []
        self._redraw(max(1, wanted))

    # -- what StreamFetcher offers ---------------------------------------------
    @property
    def transport(self) -> str:
        """What carried the last batch of the first share."""
        return self._shares[0].fetcher.transport if self._shares else ""

    @property
    def daemons_in_use(self) -> int:
        """Daemons this stream's batches are drawn from now."""
        return len({id(share.member) for share in self._shares})

    def get(self) -> HostBatch | None:
        """The next batch in order, or None at the end of the stream.

        Raises:
            ServiceUnavailable: every daemon of the pool was gone for
                ``reconnect_timeout_s``, naming them all, the rank and the cursor.
            FeederError: what else ended the stream (a daemon's DATA_LOSS, say).
        """
        started = time.monotonic()
        while True:
            self._follow_the_pool()
            share = self._shares[self._number % len(self._shares)]
            item = share.fetcher.poll(_POLL_S)
            if item is PENDING:
                self._if_stuck(share, started)
                continue
            break
        self._resize_if_needed(time.monotonic() - started)
        if item is None:
            self.finished.set()
            return None
        batch: HostBatch = item  # type: ignore[assignment]
        self._number += 1
        self._advance(batch)
        return batch

    def close(self) -> None:
        """End every share's stream."""
        for share in self._shares:
            share.fetcher.close()
        self._shares = []

    # -- inside ------------------------------------------------------------------
    def _advance(self, batch: HostBatch) -> None:
        """Where the next batch starts, after ``batch``: its cursor, or the next
        epoch's start once this epoch's part has no batch left."""
        epoch, cursor = batch.meta.epoch, batch.meta.cursor
        if self._specs.batches_after(cursor, self.request.batch_size, epoch) == 0:
            epoch, cursor = epoch + 1, 0
        self.epoch, self.cursor = epoch, cursor

    def _request(self, stride: int, offset: int) -> feeder_pb2.StreamRequest:
        """One share's request: from the next batch, every ``stride``-th from ``offset``."""
        request = feeder_pb2.StreamRequest()
        request.CopyFrom(self.request)
        request.epoch, request.start_cursor, request.epochs = self.epoch, self.cursor, self.end_epoch - self.epoch
        if self.epoch != self.request.epoch:
            del request.consumed[:]  # what earlier ranks consumed was of the first epoch only
        request.batch_stride, request.batch_offset = stride, offset
        return request

    def _fetcher(self, member: Member, request: feeder_pb2.StreamRequest) -> StreamFetcher:
        conn, config = member.connection, self._config
        # The pool decides when a daemon has failed; a share only reopens meanwhile.
        return StreamFetcher(conn.stream_batches, request, member.address, config.prefetch_batches,
                             reconnect_timeout_s=config.reconnect_timeout_s, pin=self._pin,
                             stall_timeout_s=config.stall_timeout_s, release=conn.releaser, shm_dir=config.shm_dir)

    def _redraw(self, count: int) -> None:
        """Draw the shares afresh from the next batch, over ``count`` usable daemons."""
        self.close()
        members = self._pool.usable()[:count]
        if not members:
            members = [self._pool.members[0]]  # all failed: wait on the first (see _if_stuck)
        self._shares = [_Share(m, self._fetcher(m, self._request(len(members), k))) for k, m in enumerate(members)]
        self._number = 0  # batches handed out since the shares were drawn
        self._generation = self._pool.generation
        self._changed_s = time.monotonic()

    def _take_over(self, share: _Share) -> None:
        """Another usable daemon serves ``share`` from the batch the rank needs next."""
        others = [m for m in self._pool.usable() if m is not share.member]
        if not others:
            return
        load = {id(m): sum(s.member is m for s in self._shares) for m in others}
        target = min(others, key=lambda m: load[id(m)])
        share.fetcher.close()
        share.member, share.fetcher = target, self._fetcher(target, self._request(len(self._shares), 0))
        self.reconnects += 1  # its numbering starts at the batch due now, of this share's class

    def _if_stuck(self, share: _Share, waited_since: float) -> None:
        """Take a failing or stalled share over; give up once no daemon has been
        usable for ``reconnect_timeout_s``."""
        if share.member.usable and (share.fetcher.failing
                                    or time.monotonic() - waited_since > self._config.pool_stall_timeout_s):
            why = "refused or unreachable" if share.fetcher.failing else "stalled"
            self._pool.fail(share.member, why)
        if not share.member.usable:
            self._take_over(share)
        down_since = self._pool.all_failed_since()
        if down_since is not None and time.monotonic() - down_since > self._config.reconnect_timeout_s:
            r = self.request
            raise ServiceUnavailable(
                f"every daemon of the pool gone for {self._config.reconnect_timeout_s:g} s ({self._pool.names()}), "
                f"streaming dataset {r.dataset!r} split {r.split!r} to rank {r.rank} of {r.world_size}, "
                f"epoch {self.epoch}, cursor {self.cursor}")

    def _follow_the_pool(self) -> None:
        """Redraw the shares when a member is usable again or was added (``as-needed``
        keeps its count of daemons, ``all`` takes every usable one)."""
        if self._pool.generation != self._generation:
            usable = len(self._pool.usable())
            wanted = len(self._shares) if self._config.pool == "as-needed" else usable
            self._redraw(max(1, min(wanted, usable)))

    def _resize_if_needed(self, waited_s: float) -> None:
        """``as-needed``: one daemon more while the wait is high, one fewer while low."""
        share = self._wait.add(waited_s)
        if self._config.pool != "as-needed" or share is None:
            return
        usable, in_use = len(self._pool.usable()), len(self._shares)
        if share > _GROW_ABOVE and in_use < usable:
            _log.info("waiting %.1f %% of the time on %d daemon(s): one more", 100 * share, in_use)
            self._redraw(in_use + 1)
        elif share < _SHRINK_BELOW and in_use > 1:
            _log.info("waiting %.2f %% of the time on %d daemons: one fewer", 100 * share, in_use)
            self._redraw(in_use - 1)
