"""The background half of ``FeederLoader``: a thread that keeps a gRPC batch stream
open, turns each message into host tensors and puts them in a bounded queue.

It owns the reconnect policy: on a transient failure, or when the stream has sent
nothing for ``stall_timeout_s`` while the consumer waits, it reopens the stream at the
cursor after the last batch it queued, with exponential backoff, until a deadline
measured from the first failure in a row; bad-argument errors end it at once. A
daemon that refuses for a budget (RESOURCE_EXHAUSTED) is asked again the same way
(another stream may end and free what is missing), and if it still refuses at the
deadline the error raised is its refusal, with its message.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc

from core.errors import FeederError, ServiceUnavailable, error_for_code
from protos import feeder_pb2
from transport.base import ReleaseSink, TransportKind, TransportUnavailable
from clients.host_batch import HostBatch, to_host
from transport.client import StreamReceiver
from transport.grpc_payload import parse_batch
from transport.ring_holder import RingRetired

_log = logging.getLogger(__name__)

__all__ = ["PENDING", "StreamFetcher", "error_from_rpc", "is_transient"]

# Codes that a daemon restart, a dropped connection or an overloaded daemon produce.
_TRANSIENT = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.CANCELLED,
    grpc.StatusCode.ABORTED,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.DEADLINE_EXCEEDED,
}
# Transient codes that are the daemon's answer, not the connection's: what the last
# attempt of a reconnect run ended with (a stall, a cancel) does not replace them.
_REFUSALS = {grpc.StatusCode.RESOURCE_EXHAUSTED}
_END = object()  # queued after the last batch of a stream
PENDING = object()  # what poll() returns when no batch came in time
_CLOSE_TIMEOUT_S = 10.0  # how long close() waits for the fetch thread to end
_FIRST_DELAY_S, _MAX_DELAY_S = 0.05, 2.0  # reconnect backoff, doubling between them
_POLL_S = 0.25  # most time get() waits between two checks for a stalled stream
# The transports a stream falls through when this process cannot use one, best first.
_DOWN = (TransportKind.CUDA_IPC, TransportKind.SHM, TransportKind.GRPC)
_NAMES = {TransportKind.CUDA_IPC: "CUDA IPC", TransportKind.SHM: "shared memory", TransportKind.GRPC: "gRPC"}


def is_transient(error: grpc.RpcError) -> bool:
    """True for failures worth retrying (daemon restart, dropped connection)."""
    code = error.code()
    if code in _TRANSIENT:
        return True
    # A connection reset mid-stream surfaces as INTERNAL with this detail.
    return code == grpc.StatusCode.INTERNAL and "RST_STREAM" in (error.details() or "")


def error_from_rpc(error: grpc.RpcError, address: str) -> FeederError:
    """The project error for a failed call to the daemon at ``address``."""
    cls = error_for_code(error.code())
    return cls(f"daemon {address}: {error.details()} ({error.code().name})")


class StreamFetcher:
    """A thread that streams ``request`` (one or more epochs, from ``request.epoch`` at
    ``request.start_cursor``) into a queue.

    Args:
        open_stream: Opens ``StreamBatches`` for a request, yielding each ``Batch``
            as the raw bytes received (a stub method without a deserializer).
        request: What to ask for; ``start_cursor`` is where the stream begins.
        address: The daemon's address, for error messages.
        depth: Batches to hold ready (the bound of the queue).
        reconnect_timeout_s: Give up after failing for this long in a row.
        pin: Put images in pinned memory (for non-blocking copies to CUDA).
        release: Hands transport slots back to the daemon (``SlotReleaser``).
        shm_dir: The shared-memory directory this client sees.
        stall_timeout_s: While the consumer waits in ``get()``, a stream that has sent
            nothing for this long is cancelled and reopened at its cursor (a daemon
            that stopped sending without ending the stream). While reconnecting, the
            wait for a stream's first batch is also capped by ``reconnect_timeout_s``.
    """

    def __init__(
        self,
        open_stream: Callable[[feeder_pb2.StreamRequest], Iterator[bytes]],
        request: feeder_pb2.StreamRequest,
        address: str,
        depth: int,
        reconnect_timeout_s: float,
        pin: bool,
        stall_timeout_s: float,
        release: ReleaseSink = lambda ref, after: None,
        shm_dir: Path = Path("/dev/shm"),
    ) -> None:
        self.request = request
        self._receiver = StreamReceiver(release, shm_dir)
        self._open = open_stream
        self._address = address
        self._timeout_s = reconnect_timeout_s
        self._stall_s = stall_timeout_s
        self._pin = pin
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        # Guarded by _call_lock: the open call, since when the thread has been waiting
        # for its next message (None: not waiting), and why get() cancelled it.
        self._call: object | None = None
        self._waiting_since: float | None = None
        self._stall_note: str | None = None
        self._call_lock = threading.Lock()
        self._failing_since: float | None = None  # first failure of the current run of them
        self._refusal: grpc.RpcError | None = None  # the daemon's last refusal in that run
        # Where a reconnect resumes: after the last batch queued.
        self.epoch, self.cursor = request.epoch, request.start_cursor
        self.end_epoch = request.epoch + max(1, request.epochs)  # first epoch not streamed
        self.finished = threading.Event()  # the daemon sent the stream's last batch
        self.reconnects = 0
        self._thread = threading.Thread(target=self._run, name="feeder-stream", daemon=True)
        self._thread.start()

    # -- consumer side -----------------------------------------------------------
    def get(self) -> HostBatch | None:
        """The next batch, or None at the end of the stream. Never waits for ever:
        past ``stall_timeout_s + reconnect_timeout_s`` (and the longest backoff) with
        nothing from the thread, it raises.

        Raises:
            ServiceUnavailable: The daemon stalled or was unreachable for too long.
            ResourceExhausted: The daemon refused the stream for a budget until then.
            FeederError: What else ended the stream (bad request, closed fetcher).
        """
        return self._taken(self._wait_for_item())

    def poll(self, within_s: float) -> HostBatch | None | object:
        """As :meth:`get`, but waiting at most ``within_s``: :data:`PENDING` when no
        batch came by then (a pool of daemons decides itself when one has stalled)."""
        try:
            item = self._queue.get(timeout=within_s)
        except queue.Empty:
            if not self._thread.is_alive() and self._queue.empty():
                raise FeederError(f"stream from {self._address} is closed") from None
            return PENDING
        return self._taken(item)

    def _taken(self, item: object) -> HostBatch | None:
        if item is _END:
            self._queue.put(_END)  # later calls see the end too
            return None
        if isinstance(item, BaseException):
            self._queue.put(item)
            raise item
        return item  # type: ignore[return-value]

    @property
    def failing(self) -> bool:
        """Whether the stream's last call failed and it is being reopened (the daemon
        gone, or refusing it for a budget)."""
        return self._failing_since is not None

    def _wait_for_item(self) -> object:
        poll_s = min(self._stall_s / 4, _POLL_S)
        give_up_at = time.monotonic() + self._stall_s + self._timeout_s + _MAX_DELAY_S + _POLL_S
        while True:
            try:
                return self._queue.get(timeout=poll_s)
            except queue.Empty:
                pass
            self._cancel_if_stalled()
            if not self._thread.is_alive() and self._queue.empty():
                raise FeederError(f"stream from {self._address} is closed")
            if time.monotonic() > give_up_at:
                # Only a transport that ignores cancellation gets here.
                self._stop.set()
                self._cancel_call()
                raise self._gave_up("the stream sent nothing and did not end when cancelled")

    def _cancel_if_stalled(self) -> None:
        now = time.monotonic()
        with self._call_lock:
            since, call = self._waiting_since, self._call
            if since is None or call is None:
                return
            limit = since + self._stall_s
            if self._failing_since is not None:  # reconnecting: its deadline counts too
                limit = min(limit, self._failing_since + self._timeout_s)
            if now <= limit:
                return
            self._stall_note = f"no batch for {now - since:.1f} s"
            self._waiting_since = None  # one cancel per wait
        call.cancel()  # type: ignore[attr-defined]

    def _gave_up(self, cause: str) -> FeederError:
        """The error that ends a reconnect run: the daemon's refusal if it refused (a
        ``ResourceExhausted`` naming its budget), else ``ServiceUnavailable``."""
        r = self.request
        what = (f"streaming dataset {r.dataset!r} split {r.split!r} to rank {r.rank} of {r.world_size}, "
                f"epoch {r.epoch}, cursor {self.cursor}")
        refusal = self._refusal
        if refusal is not None:
            return error_for_code(refusal.code())(
                f"daemon {self._address} refused the stream ({refusal.code().name}: {refusal.details()}) "
                f"and still refused after {self._timeout_s:g} s, {what}"
            )
        return ServiceUnavailable(f"daemon {self._address} stalled or unreachable for {self._timeout_s:g} s, "
                                  f"{what} (last error: {cause})")

    def close(self) -> None:
        """Cancels the stream and waits for the thread to end; a second call does nothing."""
        self._stop.set()
        if threading.current_thread() is self._thread:
            # The loader's finalizer, run by a garbage collection that happened on this
            # thread: it cannot wait for itself, and stops at its next check of _stop.
            self._cancel_call()
            return
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while self._thread.is_alive():
            if time.monotonic() > deadline:
                # A daemon thread: it cannot keep the process alive, and a training
                # job's shutdown must not hang on it.
                warnings.warn(f"stream from {self._address} did not stop within "
                              f"{_CLOSE_TIMEOUT_S:.0f} s; leaving its thread behind", stacklevel=2)
                return
            # Cancel on every pass: the thread may have opened a new call (a reconnect)
            # after an earlier pass read the previous one.
            self._cancel_call()
            try:
                self._queue.get_nowait()  # unblock a pending put
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def _cancel_call(self) -> None:
        with self._call_lock:
            call = self._call
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]

    # -- the thread ----------------------------------------------------------------
    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            self._fetch()
        finally:
            self._receiver.close()

    @property
    def transport(self) -> str:
        """What carried the last batch: ``shm``, ``grpc`` or ``cuda_ipc`` (empty before
        the first)."""
        kind = self._receiver.kind
        return kind.name.lower() if kind is not None else ""

    def _fetch(self) -> None:
        delay_s = _FIRST_DELAY_S
        while not self._stop.is_set():
            try:
                for message in self._messages(self._stream_from(self.epoch, self.cursor)):
                    batch = to_host(self._receiver.receive(parse_batch(message)), self._pin)
                    self.epoch, self.cursor = batch.meta.epoch, batch.meta.cursor
                    self._failing_since, self._refusal, delay_s = None, None, _FIRST_DELAY_S
                    if not self._put(batch):
                        return
                self.finished.set()
                self._put(_END)
                return
            except grpc.RpcError as e:
                if self._stop.is_set() or not self._may_retry(e):
                    return
                self.reconnects += 1
                self._stop.wait(delay_s)
                delay_s = min(delay_s * 2, _MAX_DELAY_S)
            except RingRetired:
                # The daemon gave the stream's ring back before this process opened it
                # (the stream had ended meanwhile): the same again, from the cursor.
                self._cancel_call()
                self.reconnects += 1
                self._stop.wait(delay_s)
                delay_s = min(delay_s * 2, _MAX_DELAY_S)
            except TransportUnavailable as e:
                if not self._fall_back(e):
                    return
            except Exception as e:  # noqa: BLE001 - handed to the consumer thread
                self._put(e)
                return

    def _fall_back(self, error: TransportUnavailable) -> bool:
        """This process cannot use the transport that carried the last message (no
        CUDA IPC here, another mount of /dev/shm, no permission): the rest of the
        stream is asked for over the next one down, CUDA IPC -> shared memory -> the
        gRPC payload, with one warning. False (the error queued) when none is left."""
        failed = self._receiver.kind
        asked = TransportKind(self.request.transport)
        # Below both what failed and what was asked for: a daemon that answered a
        # request for shared memory with CUDA IPC again must not make this loop.
        below = max(_DOWN.index(k) if k in _DOWN else 0 for k in (failed, asked)) + 1
        if failed is None or below >= len(_DOWN):
            self._put(error)
            return False
        instead = _DOWN[below]
        _log.warning("daemon %s: %s unusable here (%s); batches come over %s", self._address,
                     _NAMES[failed], error, _NAMES[instead])
        self._cancel_call()
        self.request.transport = instead.value
        self.reconnects += 1
        return True

    def _may_retry(self, error: grpc.RpcError) -> bool:
        """Whether to reopen the stream after ``error``; if not, the error that ends
        it is queued for the consumer."""
        if not is_transient(error):
            self._put(error_from_rpc(error, self._address))
            return False
        if error.code() in _REFUSALS:
            self._refusal = error
        now = time.monotonic()
        self._failing_since = self._failing_since or now
        if now - self._failing_since < self._timeout_s:
            return True
        self._put(self._gave_up(self._last_error(error)))
        return False

    def _last_error(self, error: grpc.RpcError) -> str:
        with self._call_lock:
            note, self._stall_note = self._stall_note, None
        return note or f"{error.code().name}: {error.details()}"

    def _stream_from(self, epoch: int, cursor: int) -> object:
        request = feeder_pb2.StreamRequest()
        request.CopyFrom(self.request)
        request.epoch, request.start_cursor, request.epochs = epoch, cursor, self.end_epoch - epoch
        if epoch != self.request.epoch:
            del request.consumed[:]  # what earlier ranks consumed was of the first epoch only
        call = self._open(request)
        with self._call_lock:
            self._call, self._stall_note = call, None
            stopped = self._stop.is_set()
        if stopped:  # close() ran while the call was being opened
            call.cancel()  # type: ignore[attr-defined]
        return call

    def _messages(self, call: object) -> Iterator[feeder_pb2.Batch]:
        """The call's messages; each wait for one is visible to ``_cancel_if_stalled``
        (the time the thread spends on a full queue is not)."""
        self._mark_waiting(time.monotonic())
        iterator = iter(call)  # type: ignore[call-overload]
        while True:
            try:
                message = next(iterator)
            except StopIteration:
                return
            finally:
                self._mark_waiting(None)
            yield message
            self._mark_waiting(time.monotonic())

    def _mark_waiting(self, since: float | None) -> None:
        with self._call_lock:
            self._waiting_since = since
