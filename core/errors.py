"""The project's error hierarchy, and the one table that maps each error to a gRPC
status code and to a one-line CLI message.

Library code raises these; the CLI and the gRPC servicer translate them. Nothing
else in the project should decide how an error looks to a user.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:  # grpc loads where a call is made: the sharder's processes never start its threads
    import grpc

__all__ = [
    "ConfigError",
    "DataError",
    "FeederError",
    "IdentityMismatch",
    "InvalidArgument",
    "Located",
    "NotFound",
    "PermissionDenied",
    "ResourceExhausted",
    "SampleCorrupt",
    "SamplesUnreadable",
    "ServiceUnavailable",
    "Unauthenticated",
    "Unreadable",
    "cli_message",
    "error_for_code",
    "grpc_code",
    "is_cli_message",
    "os_error_reason",
]


class FeederError(Exception):
    """Base of every error feeder raises on purpose."""


class ConfigError(FeederError):
    """A command-line option or configuration value that cannot work."""


class IdentityMismatch(ConfigError):
    """A request for other data or pixels than the daemon serves under the name: the
    dataset re-sharded, its index changed, or options that change pixels differ (the
    message names both sides)."""


class InvalidArgument(FeederError):
    """A request field that makes no sense (the message names the field)."""


class NotFound(FeederError):
    """A dataset, split, path or key that does not exist."""


class DataError(FeederError):
    """Input data that is corrupt, truncated or inconsistent (names the input)."""


class Located(Protocol):
    """Where a shard is, other than a local path (an object's URL): printed whole,
    with a ``name`` (its last part)."""

    @property
    def name(self) -> str: ...


class SampleCorrupt(DataError):
    """Sample bytes read from a tar that differ from their checksum in the index: the
    tar was changed after it was sharded, and those bytes are not the sample.

    Attributes:
        path: the tar (a path, or the URL of an object in a store).
        key: the sample's key.
        index: the sample's row in its split's index.
        half: the bytes were its half-scale copy's.
    """

    def __init__(self, path: Path | Located, key: str, index: int, half: bool = False) -> None:
        what = f"the half-scale copy of sample {key}" if half else f"sample {key}"
        super().__init__(f"{path}: {what} differs from its checksum in the index (changed after sharding)")
        self.path: Path | Located = Path(path) if isinstance(path, str | os.PathLike) else path
        self.key, self.index, self.half = key, index, half

    def __reduce__(self) -> tuple[type[SampleCorrupt], tuple[Path | Located, str, int, bool]]:
        return type(self), (self.path, self.key, self.index, self.half)


@dataclass(frozen=True)
class Unreadable:
    """One sample a store will not give (see :class:`SamplesUnreadable`)."""

    url: str  # the object (shard) it is in
    key: str
    index: int  # its row in its split's index
    half: bool  # its half-scale copy was asked for
    reason: str  # what the store said, e.g. "404 Not Found"


class SamplesUnreadable(DataError):
    """Samples of a batch whose bytes a store refuses for good: the object is gone,
    access to it is denied, or it is shorter than the index says. Bad data under the
    error policy, like a sample that does not decode; transient failures (5xx,
    throttling, connection resets) are retried and never end here.

    Attributes:
        samples: each sample that could not be read, with its object's URL.
    """

    def __init__(self, samples: list[Unreadable]) -> None:
        first = samples[0]
        what = f"the half-scale copy of sample {first.key}" if first.half else f"sample {first.key}"
        more = f" (and {len(samples) - 1} more of the batch)" if len(samples) > 1 else ""
        super().__init__(f"{first.url}: {what} cannot be read: {first.reason}{more}")
        self.samples = list(samples)

    def __reduce__(self) -> tuple[type[SamplesUnreadable], tuple[list[Unreadable]]]:
        return type(self), (self.samples,)


class ServiceUnavailable(FeederError):
    """A daemon that cannot be reached, or is shutting down."""


class ResourceExhausted(FeederError):
    """A request the daemon refuses because it would pass one of its budgets (memory,
    streams per peer); the message names the budget and what the request needs."""


class Unauthenticated(FeederError):
    """A call without the daemon's token, or with a wrong one; credentials a store
    refused or found expired."""


class PermissionDenied(FeederError):
    """Credentials that are valid but not allowed what was asked (a store's 403)."""


# By name of grpc.StatusCode.
_GRPC_CODES: dict[type[FeederError], str] = {
    ConfigError: "FAILED_PRECONDITION",
    InvalidArgument: "INVALID_ARGUMENT",
    NotFound: "NOT_FOUND",
    DataError: "DATA_LOSS",
    ServiceUnavailable: "UNAVAILABLE",
    ResourceExhausted: "RESOURCE_EXHAUSTED",
    Unauthenticated: "UNAUTHENTICATED",
    PermissionDenied: "PERMISSION_DENIED",
    FeederError: "INTERNAL",
}

_CLI_PREFIXES: dict[type[FeederError], str] = {
    ConfigError: "error",
    InvalidArgument: "error",
    NotFound: "not found",
    DataError: "bad data",
    ServiceUnavailable: "unavailable",
    ResourceExhausted: "over budget",
    Unauthenticated: "not authenticated",
    PermissionDenied: "permission denied",
    FeederError: "error",
}


def _lookup(table: dict, error: FeederError):
    for cls in type(error).__mro__:
        if cls in table:
            return table[cls]
    return table[FeederError]


def error_for_code(code: grpc.StatusCode) -> type[FeederError]:
    """The error a client raises for a call that ended with ``code`` (the table read
    backwards; codes no feeder error maps to give :class:`FeederError`)."""
    for cls, mapped in _GRPC_CODES.items():
        if mapped == code.name and cls is not FeederError:
            return cls
    return FeederError


def grpc_code(error: FeederError) -> grpc.StatusCode:
    """The gRPC status code a servicer should abort with for ``error``."""
    import grpc

    return getattr(grpc.StatusCode, _lookup(_GRPC_CODES, error))


def cli_message(error: FeederError) -> str:
    """The single line the CLI prints for ``error`` (no traceback)."""
    return f"feeder: {_lookup(_CLI_PREFIXES, error)}: {error}"


def is_cli_message(line: str) -> bool:
    """Whether ``line`` is one :func:`cli_message` made (a command's last word when it
    fails): what a parent reading a feeder command's output looks for."""
    return any(line.startswith(f"feeder: {prefix}: ") for prefix in set(_CLI_PREFIXES.values()))


def os_error_reason(error: OSError) -> str:
    """What an ``OSError`` says went wrong, as the tail of a message: the text of its
    errno (``no space left on device``), whatever wrapped it (pyarrow, LMDB, a
    buffered write), else its own text, first letter in lower case."""
    if error.errno:
        text = os.strerror(error.errno)
    else:
        text = error.strerror or str(error) or "unknown error"
    return text[:1].lower() + text[1:]
