"""The one owner of where a rank's next batch comes from: the stream of one daemon, or
of a pool of them, kept going through every failure by reopening from the plan.

A stream's batches are numbered by its plan (:class:`protocol.stream_plan.StreamWindow`,
the daemon's own numbering). With ``k`` daemons in use the batches are shared out
from the batch ``d`` where the shares were drawn: share ``i`` serves ``d + i``,
``d + i + k``, ... on its daemon, one call with stride ``k``. Each share knows the
number of the next batch it owes; every call, first or reopened, starts there
(:meth:`StreamWindow.from_number`, offset 0), so reopening can neither skip nor
repeat a batch, and every batch received is checked against the plan (its epoch,
cursor and part) before it is handed out: a daemon whose batch is not the plan's is
left, never believed. A call's request is made from the stream's spec moved to that
batch (:meth:`Failover.spec_from`), checked as the first was, the message made last.

Calls never retry (:class:`clients.stream_call.StreamCall`); each failure is
classified once (:mod:`clients.verdicts`) and acted on here:

- the share goes at once to the least loaded other usable daemon, the failed one
  probed in the background and used again once it answers (:mod:`clients.pool`);
- with no other usable, to the same daemon after a backoff (retry here);
- a daemon left for good (``LEAVE``) is never asked again; with none left the job
  ends with its error;
- a run of failures with no batch delivered ends the job after
  ``reconnect_timeout_s``, with the daemon's refusal if it refused for a budget.

A share's daemon has stalled when it sent nothing for ``pool_stall_timeout_s`` while
another daemon is usable (``stall_timeout_s`` when it is the only one; a call's first
batch, which may wait for a pipeline to be built, three times that daemon's usual
first-batch time, at most ``_FIRST_BATCH_S``, and that while it is not known),
counted from what was asked of that daemon and when: the time its call has been
waiting for a message, never the consumer's own wait. When the pool changes (a member back or
added, ``as-needed`` taking one more or one fewer) the shares are drawn afresh from
the next batch.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from clients.config import LoaderConfig
from clients.host_batch import HostBatch, PinnedFields
from clients.pool import DaemonPool, Member
from clients.pool_size import PoolSizer
from clients.spec import respec
from clients.stream_call import END, PENDING, Broke, StreamCall
from clients.verdicts import Failure, Verdict, of_rpc, retry
from core.errors import DataError, FeederError, ServiceUnavailable
from protocol.request import StreamSpec, to_request
from protocol.stream_plan import StreamWindow
from transport.base import TransportKind, TransportUnavailable
from transport.ring_holder import RingRetired

__all__ = ["Failover"]

_log = logging.getLogger(__name__)
_POLL_S = 0.02  # how long get() waits on a share before looking at the others
_FIRST_DELAY_S, _MAX_DELAY_S = 0.05, 2.0  # backoff of a retry on the same daemon, doubling
# A call's first batch may wait for the daemon to build a pipeline: it is not stalled
# before three times the daemon's usual first-batch time, at most this (and this while
# that is not known yet), whatever pool_stall_timeout_s is.
_FIRST_BATCH_S = 5.0
# The transports a call falls through when this process cannot use one, best first.
_DOWN = (TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.GRPC)
_NAMES = {TransportKind.CUDA_IPC: "CUDA IPC", TransportKind.SHM: "shared memory", TransportKind.GRPC: "gRPC"}


class _Share:
    """One share of the stream: its daemon, the next batch it owes, and its call."""

    def __init__(self, member: Member, owes: int) -> None:
        self.member, self.owes = member, owes
        self.call: StreamCall | None = None
        self.timed = False  # the call's first batch time is told to its daemon
        self.open_at = 0.0  # when to open the next call (a backoff)
        self.delay_s = _FIRST_DELAY_S


class Failover:
    """The batches of ``spec`` (as one daemon alone would stream them), from ``pool``.

    Args:
        pool: the daemons (one, or several).
        spec: what one daemon alone would be asked for (checked); its ``transport``
            follows what this process can use.
        window: the spec's batches, as the daemon numbers them.
        config: prefetch depth, timeouts, pool mode.
        pin: where host batches are pinned (None: not pinned).
        daemons: how many daemons to start on (``as-needed``: what the loader's
            last stream ended with; 0: the pool mode's own start).
    """

    def __init__(self, pool: DaemonPool, spec: StreamSpec, window: StreamWindow,
                 config: LoaderConfig, pin: PinnedFields | None, daemons: int = 0) -> None:
        self.spec, self._window = spec, window
        self._pool, self._config, self._pin = pool, config, pin
        self.end_epoch = window.epoch + window.epochs  # first epoch not streamed
        self.finished = threading.Event()  # every batch was handed out
        self.reconnects = 0
        self._next = 0  # number of the next batch handed out
        self._failing_since: float | None = None  # first failure of the run since the last batch
        self._refusal: Failure | None = None  # the last budget refusal of that run
        self._last: Failure | None = None  # the last failure of that run
        self._sizer = PoolSizer(config.pool)
        self._shares: list[_Share] = []
        self._drawn_at = 0
        self._generation = pool.generation
        self._draw(daemons or self._sizer.first(len(pool.usable())))

    # -- what the loader's streams read ------------------------------------------------
    @property
    def epoch(self) -> int:
        """The epoch of the next batch (``end_epoch`` once there is none)."""
        return self._place_of_next()[0]

    @property
    def cursor(self) -> int:
        """Where the next batch starts in its epoch's part."""
        return self._place_of_next()[1]

    def _place_of_next(self) -> tuple[int, int]:
        if self._next >= len(self._window):
            return self.end_epoch, 0
        place = self._window.place(self._next)
        return place.epoch, place.start

    @property
    def received_all(self) -> bool:
        """Whether every batch has been received (the daemons' side is done; some may
        still be queued here)."""
        return all(share.owes >= len(self._window) or (share.call is not None and share.call.finished.is_set())
                   for share in self._shares)

    @property
    def transport(self) -> str:
        """What carried the last batch of the first share's call."""
        calls = [share.call for share in self._shares if share.call is not None]
        return calls[0].transport if calls else ""

    @property
    def daemons_in_use(self) -> int:
        """Daemons this stream's batches are drawn from now."""
        return len({id(share.member) for share in self._shares})

    # -- the consumer's side -------------------------------------------------------------
    def get(self) -> HostBatch | None:
        """The next batch in the plan's order, or None after the last.

        Raises:
            ServiceUnavailable: no daemon delivered a batch for ``reconnect_timeout_s``
                (names the daemons, the dataset, split, rank, epoch and cursor, and the
                last error).
            ResourceExhausted: the daemons refused the stream for a budget until then.
            FeederError: the error of the last daemon left for good (another dataset,
                a request it refuses, broken data), or a batch no daemon could send.
        """
        if self._next >= len(self._window):
            self.finished.set()
            return None
        waited_since = time.monotonic()
        while True:
            self._follow_the_pool()
            share = self._shares[(self._next - self._drawn_at) % len(self._shares)]
            batch = self._from(share)
            if batch is not None:
                break
            self._give_up_if_late()
        share.owes += len(self._shares)
        self._next += 1
        self._failing_since = self._refusal = self._last = None
        share.delay_s = _FIRST_DELAY_S
        self._resize(time.monotonic() - waited_since)
        return batch

    def close(self) -> None:
        """End every share's call."""
        for share in self._shares:
            if share.call is not None:
                share.call.close()
        self._shares = []

    # -- one share -------------------------------------------------------------------------
    def _from(self, share: _Share) -> HostBatch | None:
        """The batch ``share`` owes, if it came within a poll; None otherwise (and
        whatever went wrong acted on)."""
        if share.call is None:
            wait_s = share.open_at - time.monotonic()
            if wait_s > 0:
                time.sleep(min(wait_s, _POLL_S))
                return None
            share.call, share.timed = self._open(share), False
        item = share.call.poll(_POLL_S)
        if item is PENDING:
            limit = self._stall_limit(share)
            if share.call.silent_s > limit:
                self._failed(share, retry(share.member.address, f"no batch for {share.call.silent_s:.1f} s "
                                          f"(stall timeout {limit:g} s)"))
            return None
        if item is END:
            self._failed(share, retry(share.member.address, "the stream ended before the plan's last batch"))
            return None
        if isinstance(item, Broke):
            self._broke(share, item)
            return None
        batch: HostBatch = item  # type: ignore[assignment]
        first = share.call.first_message_s
        if not share.timed and first is not None:
            share.member.saw_first_batch(first - share.call.opened_s)
            share.timed = True
        wrong = self._unplanned(share, batch)
        if wrong:
            self._failed(share, Failure(Verdict.LEAVE, DataError(f"daemon {share.member.address}: {wrong}"), wrong))
            return None
        return batch

    def _unplanned(self, share: _Share, batch: HostBatch) -> str:
        """What is wrong with ``batch`` as the batch ``share`` owes ("" where it is it)."""
        place = self._window.place(share.owes)
        part = self._window.first_part if place.epoch == self._window.epoch else self._window.part
        got = (batch.meta.epoch, batch.meta.cursor, batch.meta.samples_per_rank)
        if got == (place.epoch, place.end, part):
            return ""
        return (f"sent a batch of epoch {got[0]} ending at cursor {got[1]} of a part of {got[2]} samples where the "
                f"plan's batch {place.number} is of epoch {place.epoch}, ending at cursor {place.end} of {part}: it "
                "does not serve this plan")

    def _stall_limit(self, share: _Share) -> float:
        others = any(m is not share.member for m in self._pool.usable())
        if not others:
            return self._config.stall_timeout_s
        limit = self._config.pool_stall_timeout_s
        if share.call is not None and share.call.received == 0:
            usual = share.member.first_batch_s
            return max(limit, min(_FIRST_BATCH_S, 3 * usual) if usual else _FIRST_BATCH_S)
        return limit

    def spec_from(self, number: int, stride: int) -> StreamSpec:
        """What a call for this stream's batches from ``number`` on, every ``stride``-th,
        asks for: the stream's spec moved to that batch, checked as the first was.

        Raises:
            ConfigError: what the daemon would refuse, with its message.
        """
        window = self._window.from_number(number)
        # What earlier ranks consumed was of the first epoch only.
        consumed = self.spec.consumed if window.epoch == self._window.epoch else ()
        return respec(self.spec, epoch=window.epoch, start_cursor=window.start_cursor, epochs=window.epochs,
                      max_samples=window.max_samples, consumed=consumed, batch_stride=stride, batch_offset=0)

    def _open(self, share: _Share) -> StreamCall:
        """A call for the batches ``share`` owes: from the next one, every k-th."""
        request = to_request(self.spec_from(share.owes, len(self._shares)))
        conn, config = share.member.connection, self._config
        return StreamCall(conn.stream_batches, request, config.prefetch_batches, self._pin, release=conn.releaser,
                          shm_dir=config.shm_path)

    def _broke(self, share: _Share, broke: Broke) -> None:
        address, error = share.member.address, broke.error
        if isinstance(error, TransportUnavailable):
            self._fall_back(share, broke)
        elif isinstance(error, RingRetired):  # the ring went back before it was opened: the same again
            self._failed(share, retry(address, "the stream's ring was given back before it was opened"))
        elif isinstance(error, grpc.RpcError):
            self._failed(share, of_rpc(error, address))
        else:  # a message this client cannot read: no daemon's batches are believed past it
            raise error if isinstance(error, FeederError) else FeederError(
                f"daemon {address}: {type(error).__name__}: {error}") from error

    def _fall_back(self, share: _Share, broke: Broke) -> None:
        """This process cannot use the transport that carried the last message (no CUDA
        IPC here, another mount of /dev/shm): every call from now on asks for the next
        one down, CUDA IPC -> shared memory -> the gRPC payload, with one warning; the
        share is reopened at once."""
        failed, asked = broke.transport, TransportKind(self.spec.transport)
        # Below both what failed and what was asked for: a daemon that answered a
        # request for shared memory with CUDA IPC again must not make this loop.
        below = max(_DOWN.index(k) if k in _DOWN else 0 for k in (failed, asked)) + 1
        if failed is None or below >= len(_DOWN):
            raise FeederError(f"daemon {share.member.address}: {broke.error}") from broke.error
        instead = _DOWN[below]
        _log.warning("daemon %s: %s unusable here (%s); batches come over %s", share.member.address,
                     _NAMES[failed], broke.error, _NAMES[instead])
        self.spec = respec(self.spec, transport=instead.value)
        self._drop_call(share)
        self.reconnects += 1

    def _failed(self, share: _Share, failure: Failure) -> None:
        """Act on ``failure`` of ``share``'s daemon: the share goes to another daemon, or
        the same one after a backoff; the job ends when none is left."""
        self._drop_call(share)
        self.reconnects += 1
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        self._last = failure
        if failure.verdict is Verdict.REFUSED:
            self._refusal = failure
        if failure.verdict is Verdict.LEAVE:
            if len(self._pool.members) == 1:
                raise failure.error  # the one daemon cannot serve the stream: the job ends with its line
            self._pool.leave(share.member, failure.detail)
        elif len(self._pool.members) > 1:
            self._pool.fail(share.member, failure.detail)
        target = self._target(share)
        if target is None:
            raise failure.error
        if target is share.member:  # retry here
            share.open_at, share.delay_s = now + share.delay_s, min(share.delay_s * 2, _MAX_DELAY_S)
        else:
            share.member, share.open_at, share.delay_s = target, now, _FIRST_DELAY_S

    def _target(self, share: _Share) -> Member | None:
        """Where ``share`` goes: the least loaded other usable daemon; else its own, or
        the first not left for good; None when every daemon is left."""
        others = [m for m in self._pool.usable() if m is not share.member]
        if others:
            load = {id(m): sum(s.member is m for s in self._shares) for m in others}
            return min(others, key=lambda m: load[id(m)])
        if not share.member.left:
            return share.member
        return next((m for m in self._pool.members if not m.left), None)

    def _drop_call(self, share: _Share) -> None:
        if share.call is not None:
            share.call.abandon()
            share.call = None

    def _give_up_if_late(self) -> None:
        """Raise once the failures since the last batch have lasted ``reconnect_timeout_s``."""
        since, limit = self._failing_since, self._config.reconnect_timeout_s
        if since is None or time.monotonic() - since <= limit:
            return
        r, (epoch, cursor) = self.spec, self._place_of_next()
        what = (f"streaming dataset {r.dataset!r} split {r.split!r} to rank {r.rank} of {r.world_size}, "
                f"epoch {epoch}, cursor {cursor}")
        who = f"daemon {self._pool.members[0].address}" if len(self._pool.members) == 1 else \
            f"every daemon of the pool ({self._pool.names()})"
        refusal = self._refusal
        if refusal is not None:
            raise type(refusal.error)(f"{who} refused the stream ({refusal.detail}) and still refused "
                                             f"after {limit:g} s, {what}")
        last = self._last.detail if self._last is not None else "no answer"
        raise ServiceUnavailable(f"{who} stalled or unreachable for {limit:g} s, {what} (last error: {last})")

    # -- the pool ----------------------------------------------------------------------------
    def _draw(self, count: int) -> None:
        """Draw the shares afresh from the next batch, over ``count`` usable daemons
        (or the first not left for good, when none is usable)."""
        for share in self._shares:
            self._drop_call(share)
        members = self._pool.usable()[:max(1, count)]
        if not members:
            fallback = next((m for m in self._pool.members if not m.left), self._pool.members[0])
            members = [fallback]
        self._drawn_at = self._next
        self._shares = [_Share(m, self._next + i) for i, m in enumerate(members)]
        self._generation = self._pool.generation
        self._sizer.changed()

    def _follow_the_pool(self) -> None:
        """Draw afresh when a member came back or was added and the shares should use it
        (``as-needed`` keeps its count of daemons, ``all`` takes every usable one)."""
        if self._pool.generation == self._generation:
            return
        self._generation = self._pool.generation
        usable = self._pool.usable()
        wanted = self._sizer.wanted(len(self._shares), len(usable))
        if {id(m) for m in usable[:wanted]} != {id(s.member) for s in self._shares} or wanted != len(self._shares):
            self._draw(wanted)

    def _resize(self, waited_s: float) -> None:
        """``as-needed``: one daemon more while the wait is high, one fewer while low."""
        count = self._sizer.after_wait(waited_s, len(self._shares), len(self._pool.usable()))
        if count != len(self._shares):
            self._draw(count)
