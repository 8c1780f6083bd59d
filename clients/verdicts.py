"""What a daemon's failed stream means for where the next batch comes from, decided in
one table: every way a stream can fail is classified once (:func:`of_rpc`, and the
:class:`Failure` values the failover makes itself), and :mod:`clients.failover` acts
on the verdict alone.

- ``RETRY``: the daemon went away or dropped the call (a restart, a reset, its idle
  cancel, a stall): its share goes to another daemon of the pool at once, or, with
  none usable, to the same one after a backoff, until ``reconnect_timeout_s``.
- ``REFUSED``: the daemon refused the stream for now: for a budget
  (``RESOURCE_EXHAUSTED``: another stream may end and free what is missing), or for
  credentials (``UNAUTHENTICATED`` / ``PERMISSION_DENIED``: its store refused its
  credentials, which are rotated back or refreshed; the daemon's own token is checked
  when the loader is built). As ``RETRY``, and if it still refuses at the deadline,
  the job ends with its refusal, naming the URL.
- ``LEAVE``: this daemon cannot serve the stream (another dataset under the name,
  its limits, its data broken, a batch the plan does not have): it is left for good,
  with one line; the job ends with its error when no daemon of the pool is left.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import grpc

from core.errors import FeederError, ServiceUnavailable, error_for_code

__all__ = ["Failure", "Verdict", "error_from_rpc", "of_rpc", "retry"]


class Verdict(enum.Enum):
    """Where a failed share's next batch is asked for (see the module's docstring)."""

    RETRY = "retry"
    REFUSED = "refused"
    LEAVE = "leave"


@dataclass(frozen=True)
class Failure:
    """One failure of one daemon's stream.

    Attributes:
        verdict: what it means for the daemon.
        error: what the job ends with if it comes to that (names the daemon).
        detail: what happened, for one log line.
    """

    verdict: Verdict
    error: FeederError
    detail: str


# Every status a stream can end with. What is not listed (UNKNOWN, INTERNAL but for a
# reset, UNIMPLEMENTED, ...) is a daemon that cannot serve this stream: LEAVE.
_VERDICTS = {
    grpc.StatusCode.UNAVAILABLE: Verdict.RETRY,
    grpc.StatusCode.CANCELLED: Verdict.RETRY,  # the daemon's idle cancel, a proxy, a restart
    grpc.StatusCode.ABORTED: Verdict.RETRY,
    grpc.StatusCode.DEADLINE_EXCEEDED: Verdict.RETRY,
    grpc.StatusCode.RESOURCE_EXHAUSTED: Verdict.REFUSED,
    grpc.StatusCode.FAILED_PRECONDITION: Verdict.LEAVE,  # another dataset, index or pixel options
    grpc.StatusCode.INVALID_ARGUMENT: Verdict.LEAVE,  # its limits (--max-batch-size)
    grpc.StatusCode.NOT_FOUND: Verdict.LEAVE,  # restarted without the dataset
    grpc.StatusCode.DATA_LOSS: Verdict.LEAVE,  # more bad samples than it skips
    grpc.StatusCode.UNAUTHENTICATED: Verdict.REFUSED,  # its store's credentials refused or expired
    grpc.StatusCode.PERMISSION_DENIED: Verdict.REFUSED,
}


def error_from_rpc(error: grpc.RpcError, address: str) -> FeederError:
    """The project error for a failed call to the daemon at ``address``."""
    cls = error_for_code(error.code())
    return cls(f"daemon {address}: {error.details()} ({error.code().name})")


def of_rpc(error: grpc.RpcError, address: str) -> Failure:
    """The failure a call to ``address`` ended with (a connection reset mid-stream
    surfaces as INTERNAL with ``RST_STREAM`` in its details: RETRY)."""
    code, details = error.code(), error.details() or ""
    verdict = _VERDICTS.get(code, Verdict.LEAVE)
    if code == grpc.StatusCode.INTERNAL and "RST_STREAM" in details:
        verdict = Verdict.RETRY
    return Failure(verdict, error_from_rpc(error, address), f"{code.name}: {details}")


def retry(address: str, detail: str) -> Failure:
    """A RETRY failure the client found itself (a stall, a stream that ended early)."""
    return Failure(Verdict.RETRY, ServiceUnavailable(f"daemon {address}: {detail}"), detail)
