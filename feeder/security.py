"""Who may talk to a daemon: TLS credentials of the gRPC port, the bearer token every
call but the health check must carry, and the owner-only unix socket."""

from __future__ import annotations

import hmac
import logging
import os
import stat
from pathlib import Path
from typing import Any

import grpc

from core.errors import ConfigError, Unauthenticated, grpc_code
from core.files import read_option_file
from feeder.call_guard import HEALTH_PREFIX
from feeder.config import ServerConfig
from feeder.log_lines import RateLimitedLog
from feeder.metrics import ServerMetrics
from feeder.socket_claim import SocketClaim, answers, lock_path

log = logging.getLogger(__name__)

__all__ = ["TokenInterceptor", "listen_on_socket", "read_token", "server_credentials"]

_SOCKET_MODE = 0o600


def read_token(path: Path) -> bytes:
    """The token in ``path`` (surrounding whitespace removed).

    Raises:
        ConfigError: the file cannot be read or holds no token.
    """
    token = read_option_file("token_file", path).strip()
    if not token:
        raise ConfigError(f"token_file: {path} is empty")
    return token


def server_credentials(config: ServerConfig) -> grpc.ServerCredentials | None:
    """TLS credentials for the gRPC port, or None when the config has no certificate.

    Raises:
        ConfigError: a certificate or key file cannot be read.
    """
    security = config.security
    if security.tls_cert is None or security.tls_key is None:
        return None
    pair = (read_option_file("tls_key", security.tls_key), read_option_file("tls_cert", security.tls_cert))
    client_ca = None if security.tls_client_ca is None else read_option_file("tls_client_ca", security.tls_client_ca)
    return grpc.ssl_server_credentials([pair], root_certificates=client_ca,
                                       require_client_auth=client_ca is not None)


def _refusing(handler: grpc.RpcMethodHandler, error: Unauthenticated) -> grpc.RpcMethodHandler:
    """A handler that aborts with ``error`` before it reads a request: served as
    request-streaming whatever ``handler`` is (the wire is the same for the client),
    so grpcio does not wait for, or parse, the request of a call it will refuse."""

    def abort(_requests: Any, context: grpc.ServicerContext) -> None:
        context.abort(grpc_code(error), str(error))

    make = grpc.stream_stream_rpc_method_handler if handler.response_streaming else grpc.stream_unary_rpc_method_handler
    return make(abort, request_deserializer=None, response_serializer=handler.response_serializer)


class TokenInterceptor(grpc.ServerInterceptor):
    """Lets a call through when its ``authorization`` metadata is ``Bearer <token>``
    (compared in constant time) or it is a health check; others end UNAUTHENTICATED.

    Args:
        token: the daemon's token.
        metrics: counts refused calls.
    """

    def __init__(self, token: bytes, metrics: ServerMetrics) -> None:
        self._expected = b"Bearer " + token
        self._metrics = metrics
        self._lines = RateLimitedLog(log)

    def intercept_service(self, continuation, handler_call_details):
        handler = continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or method.startswith(HEALTH_PREFIX):
            return handler
        sent = dict(handler_call_details.invocation_metadata or ()).get("authorization", "")
        sent_bytes = sent.encode() if isinstance(sent, str) else bytes(sent)
        if hmac.compare_digest(sent_bytes, self._expected):
            return handler
        self._metrics.unauthenticated_call()
        self._lines.warning("unauthenticated", "UNAUTHENTICATED %s: %s token", method, "wrong" if sent else "no")
        return _refusing(handler, Unauthenticated(
            "authorization: missing or wrong token (send metadata 'authorization: Bearer <token>')"
        ))

    def flush(self) -> None:
        """Write the count of refusals the log rate limit left out."""
        self._lines.flush()


def listen_on_socket(server: grpc.Server, path: Path) -> SocketClaim:
    """Claim the unix socket ``path`` (:mod:`feeder.socket_claim`) and listen on it,
    created with mode 0600. A socket nothing listens on (left by a daemon that died)
    is replaced; a live one, or any other file at ``path``, is left alone.

    Returns:
        The claim: held until the server has stopped, then released (which removes
        the socket file if the server left it).

    Raises:
        ConfigError: a daemon holds the claim or serves on ``path``, ``path`` is
            another kind of file, or the socket cannot be made.
    """
    path = Path(path)
    claim = SocketClaim.take(path)
    if claim is None:
        raise ConfigError(f"socket_path: a daemon is serving on {path} (it holds {lock_path(path)}); stop it or "
                          "choose another --socket-path")
    try:
        _replace_stale(path)
    except BaseException:
        claim.release(remove_socket=False)  # what is there is not ours
        raise
    try:
        _bind(server, path)
    except BaseException:
        claim.release()
        raise
    return claim


def _replace_stale(path: Path) -> None:
    """Remove a socket left at ``path`` by a daemon that died (the claim is held)."""
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ConfigError(f"socket_path: {path} exists and is not a socket")
        if answers(path):  # a daemon that does not take the claim
            raise ConfigError(f"socket_path: a daemon is serving on {path}; stop it or choose another --socket-path")
        path.unlink()


def _bind(server: grpc.Server, path: Path) -> None:
    previous = os.umask(0o777 & ~_SOCKET_MODE)  # the socket is never group/other-accessible
    try:
        bound = server.add_insecure_port(f"unix:{path}")
    except RuntimeError as e:
        raise ConfigError(f"socket_path: cannot listen on {path} ({e})") from e
    finally:
        os.umask(previous)
    if not bound or not path.exists():
        raise ConfigError(f"socket_path: cannot listen on {path}")
    os.chmod(path, _SOCKET_MODE)
