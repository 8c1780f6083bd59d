"""The loader's connection to a daemon: plaintext or TLS (mutual TLS with a client
certificate), to ``host:port`` or ``unix:/path``, with the daemon's token sent on
every call as ``authorization: Bearer <token>`` metadata. An address gRPC could only
wait on (no port, a URL) is refused before anything connects."""

from __future__ import annotations

import collections
import ipaddress
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import grpc

from core.errors import ConfigError
from core.files import read_option_file

__all__ = [
    "ADDRESS_ENV", "ADDRESS_FORMS", "SHM_DIR_ENV", "TOKEN_ENV", "check_address", "check_token", "open_channel",
    "resolve_address", "resolve_shm_dir", "resolve_token",
]

TOKEN_ENV = "FEEDER_TOKEN"
ADDRESS_ENV = "FEEDER_ADDRESS"  # set by ``feeder run`` for the command it runs
SHM_DIR_ENV = "FEEDER_SHM_DIR"  # likewise: its daemon's --shm-dir
ADDRESS_FORMS = "host:port, [v6]:port, dns:///host:port or unix:/path"
# A host name or an IPv4 address (the name resolver says whether it exists).
_HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
_PORT = re.compile(r"[0-9]{1,5}")


def check_address(address: str) -> None:
    """Refuse a daemon address that is none of :data:`ADDRESS_FORMS` (``unix:path``
    may be relative, ``unix:///path`` is absolute; ``dns:`` may name an authority,
    ``dns://8.8.8.8/host:port``): gRPC would only wait on it until a timeout.

    Raises:
        ConfigError: naming the address.
    """
    if not _is_address(address):
        raise ConfigError(f"address: {address!r} is not {ADDRESS_FORMS}")


def _is_address(address: str) -> bool:
    if address.startswith("unix:"):
        path = address.removeprefix("unix:")
        if path.startswith("//"):
            path = path.removeprefix("//")
            return path.startswith("/") and len(path) > 1
        return bool(path) and "\0" not in path
    if address.startswith("dns:"):
        target = address.removeprefix("dns:")
        if target.startswith("//"):
            _authority, slash, target = target.removeprefix("//").partition("/")
            if not slash:
                return False
        return _is_host_port(target)
    return _is_host_port(address)


def _is_host_port(target: str) -> bool:
    host, colon, port = target.rpartition(":")
    if not colon or not _PORT.fullmatch(port) or not 1 <= int(port) <= 65535:
        return False
    if host.startswith("[") and host.endswith("]"):
        try:
            ipaddress.IPv6Address(host[1:-1])
        except ValueError:
            return False
        return True
    return _HOST.fullmatch(host) is not None


def check_token(token: str, source: str = "token") -> None:
    """Refuse a token gRPC metadata cannot carry (empty, or not printable ASCII).

    Raises:
        ConfigError: naming ``source``.
    """
    if not token:
        raise ConfigError(f"{source}: empty")
    if not all(" " < c <= "~" for c in token):
        raise ConfigError(f"{source}: must be printable ASCII without spaces")


def resolve_address(address: str | Sequence[str] | None) -> str | Sequence[str]:
    """``address`` as given, else (None or empty) the ``FEEDER_ADDRESS`` environment
    variable, read now: ``feeder run`` sets it to its node's daemon (and the pool it
    was given).

    Raises:
        ConfigError: neither is given.
    """
    if address:
        return address
    found = os.environ.get(ADDRESS_ENV, "").strip()
    if not found:
        raise ConfigError(f"address: none given and {ADDRESS_ENV} is not set (feeder run sets it)")
    return found


def resolve_shm_dir(shm_dir: str | Path | None) -> Path:
    """``shm_dir`` as given, else the ``FEEDER_SHM_DIR`` environment variable (read
    now), else ``/dev/shm``."""
    if shm_dir is not None:
        return Path(shm_dir)
    return Path(os.environ.get(SHM_DIR_ENV, "").strip() or "/dev/shm")


def resolve_token(token: str | None) -> str | None:
    """``token`` as given, else the ``FEEDER_TOKEN`` environment variable (read now),
    else None.

    Raises:
        ConfigError: ``FEEDER_TOKEN`` is set to something that is not a token.
    """
    if token is not None:
        return token
    found = os.environ.get(TOKEN_ENV)
    if found is None:
        return None
    found = found.strip()
    check_token(found, TOKEN_ENV)
    return found


class _CallDetails(
    collections.namedtuple("_CallDetails", ("method", "timeout", "metadata", "credentials", "wait_for_ready",
                                            "compression")),
    grpc.ClientCallDetails,
):
    """Concrete call details (grpc only defines the interface)."""


class _BearerToken(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds ``authorization: Bearer <token>`` to every call."""

    def __init__(self, token: str) -> None:
        self._header = ("authorization", f"Bearer {token}")

    def _with_token(self, details: grpc.ClientCallDetails) -> grpc.ClientCallDetails:
        metadata = [*(details.metadata or ()), self._header]
        return _CallDetails(details.method, details.timeout, metadata, details.credentials,
                            getattr(details, "wait_for_ready", None), getattr(details, "compression", None))

    def intercept_unary_unary(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)

    def intercept_unary_stream(self, continuation, client_call_details, request):
        return continuation(self._with_token(client_call_details), request)



def open_channel(
    address: str,
    options: Sequence[tuple[str, Any]],
    token: str | None = None,
    tls_root: str | Path | None = None,
    tls_cert: str | Path | None = None,
    tls_key: str | Path | None = None,
) -> grpc.Channel:
    """A channel to the daemon at ``address`` (``host:port`` or ``unix:/path``).

    Args:
        address: where the daemon listens.
        options: gRPC channel options.
        token: sent with every call, if given.
        tls_root: PEM CA certificate(s) that signed the daemon's certificate; None:
            plaintext.
        tls_cert: this client's PEM certificate (mutual TLS), with ``tls_key``.
        tls_key: the private key of ``tls_cert``.

    Raises:
        ConfigError: a certificate or key file cannot be read.
    """
    if tls_root is None:
        channel = grpc.insecure_channel(address, options=list(options))
    else:
        key = None if tls_key is None else read_option_file("tls_key", tls_key)
        cert = None if tls_cert is None else read_option_file("tls_cert", tls_cert)
        credentials = grpc.ssl_channel_credentials(read_option_file("tls_root", tls_root), key, cert)
        channel = grpc.secure_channel(address, credentials, options=list(options))
    if token is not None:
        channel = grpc.intercept_channel(channel, _BearerToken(token))
    return channel
