"""Calls waiting for a client's message, bounded in number and in time.

grpcio's thread-per-call server reads a unary request inside a worker thread: a call
whose client never sends its request holds that thread for as long as the client
likes, before any handler, token check or limit of the daemon runs. So every method
is served as request-streaming (the wire is the same for clients: one message each
way, or one then a stream): the handler starts at once, the guard reads the request
itself, with a deadline (the call is cancelled when it passes) and a gate on how many
calls may wait at once (past it, the one that has waited longest is cancelled), and
parses it (a malformed message is one rate-limited log line and INVALID_ARGUMENT, not
grpcio's traceback). Health checks wait in a gate and a thread pool of their own, so feeder's
calls never make them queue.
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, NoReturn

import grpc
from google.protobuf.message import DecodeError

from core.errors import FeederError, InvalidArgument, grpc_code
from feeder.deadlines import Deadlines
from feeder.log_lines import RateLimitedLog, clip
from feeder.metrics import ServerMetrics

log = logging.getLogger(__name__)

__all__ = ["HEALTH_PREFIX", "CallGuard", "WaitingCalls"]

HEALTH_PREFIX = "/grpc.health.v1.Health/"
_HEALTH_THREADS = 4  # health checks answer in microseconds; these threads only wait on clients
_HEALTH_WAITING = _HEALTH_THREADS - 1  # one thread is always free to answer or refuse

Parse = Callable[[bytes], Any]


class WaitingCalls:
    """A gate: at most ``limit`` calls wait for a client message at once, each for
    at most ``timeout_s`` (then the call is cancelled). A call that finds ``limit``
    waiting cancels the one that has waited longest and waits in its place: a client
    sends its request with its call, so a call with its request there passes the
    gate in microseconds, and calls that never send cannot keep it out however many
    they are (refusing the newcomer instead would let them).

    Args:
        limit: calls that may wait at once (at least 1).
        timeout_s: seconds a call may wait for a message.
        deadlines: the scheduler that cancels calls past their time.
        metrics: counts waiting, refused and timed-out calls.
        lines: the rate-limited log of refused calls.
    """

    def __init__(self, limit: int, timeout_s: float, deadlines: Deadlines, metrics: ServerMetrics,
                 lines: RateLimitedLog) -> None:
        self.limit, self.timeout_s = limit, timeout_s
        self._deadlines, self._metrics, self._lines = deadlines, metrics, lines
        self._lock = threading.Lock()
        self._waiting: OrderedDict[int, grpc.ServicerContext] = OrderedDict()  # oldest first
        self._tickets = itertools.count()

    def read(self, requests: Iterator[bytes], context: grpc.ServicerContext, method: str) -> bytes:
        """The next raw message of ``requests``.

        Raises:
            StopIteration: the client closed its side without a message.
            grpc.RpcError: the call was cancelled: by its client, at the deadline, or
                to let a newer call wait.
        """
        ticket = self._enter(context, method)
        deadline = self._deadlines.add(self.timeout_s, context.cancel)
        try:
            return next(requests)
        except (grpc.RpcError, StopIteration):  # a cancelled call may end either way
            if not self._deadlines.clear(deadline):
                self._metrics.call_refused("timeout")
                self._lines.warning("first message timeout", "CANCELLED %s from %s: no request message "
                                    "within %g s", method, clip(context.peer()), self.timeout_s)
            raise
        finally:
            self._deadlines.clear(deadline)
            self._leave(ticket)

    def _enter(self, context: grpc.ServicerContext, method: str) -> int:
        with self._lock:
            oldest = self._waiting.popitem(last=False)[1] if len(self._waiting) >= self.limit else None
            ticket = next(self._tickets)
            self._waiting[ticket] = context
        self._metrics.call_waiting(+1)
        if oldest is not None:
            self._metrics.call_refused("waiting")
            self._lines.warning("too many waiting calls", "CANCELLED the longest waiting of %d calls without "
                                "their request message, for %s from %s", self.limit, method, clip(context.peer()))
            oldest.cancel()
        return ticket

    def _leave(self, ticket: int) -> None:
        with self._lock:
            self._waiting.pop(ticket, None)
        self._metrics.call_waiting(-1)


class _Call:
    """What the guarded behaviour of one call needs: its gate, method and parser."""

    def __init__(self, gate: WaitingCalls, method: str, parse: Parse | None, lines: RateLimitedLog,
                 metrics: ServerMetrics) -> None:
        self.gate, self.method, self._parse = gate, method, parse
        self._lines, self._metrics = lines, metrics

    def first(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Any:
        """The call's one request, parsed (aborts the call on a refusal)."""
        try:
            return self.parse(self.gate.read(requests, context, self.method), context)
        except StopIteration:
            self.abort(context, InvalidArgument("request: the call was closed before its request message"))
        except FeederError as e:
            self.abort(context, e)

    def each(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[Any]:
        """Every request of a request-streaming call, each wait through the gate."""
        while True:
            try:
                raw = self.gate.read(requests, context, self.method)
            except StopIteration:
                return
            except FeederError as e:
                self.abort(context, e)
            yield self.parse(raw, context)

    def parse(self, raw: bytes, context: grpc.ServicerContext) -> Any:
        if self._parse is None:
            return raw
        try:
            return self._parse(raw)
        except DecodeError:
            self._metrics.call_refused("malformed")
            self._lines.warning("malformed request", "INVALID_ARGUMENT %s from %s: malformed request message "
                                "(%d bytes)", self.method, clip(context.peer()), len(raw))
            self.abort(context, InvalidArgument(f"request: not a valid request message for {self.method}"))

    @staticmethod
    def abort(context: grpc.ServicerContext, error: FeederError) -> NoReturn:
        context.abort(grpc_code(error), str(error))
        raise error  # context.abort raises; this line keeps type checkers honest


def _behaviour(handler: grpc.RpcMethodHandler, call: _Call) -> Callable[..., Any]:
    """``handler``'s behaviour taking a request iterator of raw messages."""
    if handler.request_streaming:
        inner = handler.stream_stream if handler.response_streaming else handler.stream_unary

        def streaming(requests: Iterator[bytes], context: grpc.ServicerContext, *send: Any) -> Any:
            return inner(call.each(requests, context), context, *send)

        return streaming
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

    def unary(requests: Iterator[bytes], context: grpc.ServicerContext, *send: Any) -> Any:
        return inner(call.first(requests, context), context, *send)

    return unary


def _guarded(handler: grpc.RpcMethodHandler, call: _Call, pool: futures.ThreadPoolExecutor | None
            ) -> grpc.RpcMethodHandler:
    """``handler`` served as request-streaming, its requests read through ``call``;
    run on ``pool`` when given (grpcio's per-behaviour thread pool hook)."""
    behaviour: Any = _behaviour(handler, call)
    inner = next(b for b in (handler.unary_unary, handler.unary_stream, handler.stream_unary,
                             handler.stream_stream) if b is not None)
    if getattr(inner, "experimental_non_blocking", False):  # health Watch: returns at once, answers later
        behaviour.experimental_non_blocking = True
    if pool is not None:
        behaviour.experimental_thread_pool = pool
    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(behaviour, request_deserializer=None, response_serializer=handler.response_serializer)


class CallGuard(grpc.ServerInterceptor):
    """Serves every method through a gate on calls waiting for a message: health
    checks through a small gate and thread pool of their own, every other method
    through ``max_waiting_calls`` on the server's workers.

    Args:
        max_waiting_calls: feeder (and reflection) calls that may wait at once.
        timeout_s: seconds any call may wait for a request message.
        metrics: the daemon's counters.
    """

    def __init__(self, max_waiting_calls: int, timeout_s: float, metrics: ServerMetrics) -> None:
        self._deadlines = Deadlines("feeder-deadlines")
        self._lines = RateLimitedLog(log)
        self._metrics = metrics
        self._health_pool = futures.ThreadPoolExecutor(_HEALTH_THREADS, thread_name_prefix="feeder-health")
        self._gates = {
            True: WaitingCalls(_HEALTH_WAITING, timeout_s, self._deadlines, metrics, self._lines),
            False: WaitingCalls(max_waiting_calls, timeout_s, self._deadlines, metrics, self._lines),
        }

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        health = method.startswith(HEALTH_PREFIX)
        call = _Call(self._gates[health], method, handler.request_deserializer, self._lines, self._metrics)
        return _guarded(handler, call, self._health_pool if health else None)

    def close(self) -> None:
        """Stop the deadline thread and the health pool (after the server stopped)."""
        self._lines.flush()
        self._deadlines.close()
        self._health_pool.shutdown(wait=False)
