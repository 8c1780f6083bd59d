"""One ``StreamBatches`` call and the thread that drains it: each message turned into
host tensors and put in a bounded queue, then how the call ended.

A call never retries and never decides anything: it ends with :data:`END` (the
daemon sent its last batch) or a :class:`Broke` carrying what ended it, and
:mod:`clients.failover` decides what happens next. It keeps one fact for that
decision: since when it has been waiting for the daemon's next message
(:attr:`StreamCall.silent_s`; not while its queue is full, which is the consumer's
doing, not the daemon's).
"""

from __future__ import annotations

import queue
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from clients.host_batch import PinnedFields, to_host
from protos import feeder_pb2
from transport.base import ReleaseSink, TransportKind
from transport.client import StreamReceiver
from transport.grpc_payload import parse_batch

__all__ = ["END", "PENDING", "Broke", "StreamCall"]

END = object()  # the daemon sent the call's last batch
PENDING = object()  # no batch came in time
_CLOSE_TIMEOUT_S = 10.0  # how long close() waits for the thread to end
_PUT_POLL_S = 0.1  # how often a put on a full queue looks at the stop flag


@dataclass(frozen=True)
class Broke:
    """How a call ended other than at its end.

    Attributes:
        error: what was raised (a ``grpc.RpcError``, a transport's error, anything
            else the receiving raised).
        transport: what carried the call's last message (None before the first).
    """

    error: BaseException
    transport: TransportKind | None


class StreamCall:
    """A thread streaming ``request`` into a queue of ``depth`` batches.

    Args:
        open_stream: opens ``StreamBatches`` for a request, yielding each ``Batch``
            as the raw bytes received.
        request: what to ask for (not changed).
        depth: batches held ready.
        pin: where a CUDA consumer's batches are pinned (None: not pinned).
        release: hands transport slots back to the daemon.
        shm_dir: the shared-memory directory this client sees.
    """

    def __init__(self, open_stream: Callable[[feeder_pb2.StreamRequest], Iterator[bytes]],
                 request: feeder_pb2.StreamRequest, depth: int, pin: PinnedFields | None,
                 release: ReleaseSink = lambda ref, after: None, shm_dir: Path = Path("/dev/shm")) -> None:
        self.request = request
        self._open, self._pin = open_stream, pin
        self._receiver = StreamReceiver(release, shm_dir)
        self._queue: queue.Queue[object] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._lock = threading.Lock()  # guards _call and _waiting_since
        self._call: object | None = None
        self._waiting_since: float | None = time.monotonic()
        self.finished = threading.Event()  # the daemon sent the last batch
        self.received = 0  # messages received
        self.opened_s = time.monotonic()
        self.first_message_s: float | None = None  # when the first message came
        self._thread = threading.Thread(target=self._run, name="feeder-stream", daemon=True)
        self._thread.start()

    # -- consumer side ---------------------------------------------------------------
    def poll(self, within_s: float) -> object:
        """The next item, waiting at most ``within_s``: a :class:`HostBatch`, :data:`END`,
        a :class:`Broke`, or :data:`PENDING` when nothing came by then."""
        try:
            return self._queue.get(timeout=within_s)
        except queue.Empty:
            return PENDING

    @property
    def silent_s(self) -> float:
        """Seconds the call has been waiting for the daemon's next message (0 while
        its queue is full, or once it ended)."""
        with self._lock:
            since = self._waiting_since
        return 0.0 if since is None else time.monotonic() - since

    @property
    def transport(self) -> str:
        """What carried the last batch: ``shm``, ``grpc`` or ``cuda_ipc`` (empty before the first)."""
        kind = self._receiver.kind
        return kind.name.lower() if kind is not None else ""

    def abandon(self) -> None:
        """Cancel the call without waiting for its thread (it ends at its next look at
        the stop flag; what it queued is not read)."""
        self._stop.set()
        self._cancel()

    def close(self) -> None:
        """Cancel the call and wait for the thread to end; a second call does nothing."""
        self.abandon()
        if threading.current_thread() is self._thread:
            return  # a finalizer run on this thread: it stops at its next look at the flag
        deadline = time.monotonic() + _CLOSE_TIMEOUT_S
        while self._thread.is_alive():
            if time.monotonic() > deadline:
                # A daemon thread: it cannot keep the process alive, and a training
                # job's shutdown must not hang on it.
                warnings.warn(f"a stream of dataset {self.request.dataset!r} did not stop within "
                              f"{_CLOSE_TIMEOUT_S:.0f} s; leaving its thread behind", stacklevel=2)
                return
            self._cancel()  # the call may have been opened after the last pass
            try:
                self._queue.get_nowait()  # unblock a pending put
            except queue.Empty:
                pass
            self._thread.join(timeout=0.05)

    def _cancel(self) -> None:
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()  # type: ignore[attr-defined]

    # -- the thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            for message in self._messages():
                if not self._put(to_host(self._receiver.receive(parse_batch(message)), self._pin)):
                    return
            self.finished.set()
            self._put(END)
        except Exception as e:  # noqa: BLE001 - every way a call ends goes to the failover
            self._put(Broke(e, self._receiver.kind))
        finally:
            self._mark_waiting(None)
            self._receiver.close()

    def _put(self, item: object) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_PUT_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def _messages(self) -> Iterator[bytes]:
        """The call's messages; the time each one is waited for is :attr:`silent_s`."""
        call = self._open(self.request)
        with self._lock:
            self._call = call
        if self._stop.is_set():  # abandoned while the call was being opened
            call.cancel()  # type: ignore[attr-defined]
        iterator = iter(call)  # type: ignore[call-overload]
        while True:
            self._mark_waiting(time.monotonic())
            try:
                message = next(iterator)
            except StopIteration:
                return
            finally:
                self._mark_waiting(None)
            self.received += 1
            if self.first_message_s is None:
                self.first_message_s = time.monotonic()
            yield message

    def _mark_waiting(self, since: float | None) -> None:
        with self._lock:
            self._waiting_since = since
