"""Names of objects in a store (``s3://bucket/prefix``, ``gs://``, ``az://``), the
errors a store's answers become, and the one place where the client library's
errors are read (:func:`classify`).

A root given as a URL of one of ``SCHEMES`` is remote; anything else is a local path
(``file:///data/shards`` is ``/data/shards``). The store's errors become the project's
own, each naming the URL: a missing bucket or object is :class:`ObjectMissing`
(``NotFound``), refused credentials :class:`StoreRefused` (``Unauthenticated``), a
store that cannot be reached or keeps failing :class:`StoreUnreachable`
(``ServiceUnavailable``), an object shorter than asked :class:`ObjectShort`
(``DataError``).
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from core.errors import (
    ConfigError,
    DataError,
    FeederError,
    NotFound,
    PermissionDenied,
    ServiceUnavailable,
    Unauthenticated,
)

__all__ = [
    "SCHEMES",
    "Failure",
    "ObjectMissing",
    "ObjectShort",
    "ObjectUrl",
    "StoreFault",
    "StoreForbidden",
    "StoreRefused",
    "StoreUnreachable",
    "classify",
    "is_remote",
    "local_path",
    "store_error",
]

# URL scheme -> the kind of store (obstore's names: its S3Store, GCSStore, AzureStore).
SCHEMES = {"s3": "s3", "gs": "gcs", "az": "azure", "abfs": "azure", "abfss": "azure"}
_URL = re.compile(r"^(?P<scheme>[a-z0-9]+)://(?P<bucket>[^/]+)(?P<key>/.*)?$")


def is_remote(text: str | Path) -> bool:
    """True for the URL of an object store root (``s3://``, ``gs://``, ``az://``...)."""
    match = _URL.match(str(text)) if isinstance(text, str) else None
    return match is not None and match["scheme"] in SCHEMES


def local_path(text: str) -> Path:
    """A local root as a path: ``file:///x`` is ``/x``; ``~`` is expanded."""
    return Path(text.removeprefix("file://") if text.startswith("file:///") else text).expanduser()


@dataclass(frozen=True)
class ObjectUrl:
    """An object, or a prefix of objects, in a store: ``s3://bucket/a/b``.

    ``url / "c"`` is ``s3://bucket/a/b/c``; ``str(url)`` the URL; ``name`` its last
    part (as a path's).
    """

    scheme: str
    bucket: str
    key: str = ""  # without leading or trailing "/"; "" for the bucket itself

    @classmethod
    def parse(cls, text: str) -> ObjectUrl:
        """Raises ConfigError: not the URL of a store this code reads (names it)."""
        match = _URL.match(text)
        if match is None or match["scheme"] not in SCHEMES:
            raise ConfigError(f"{text!r}: not an object store URL ({', '.join(f'{s}://' for s in SCHEMES)})")
        key = (match["key"] or "").strip("/")
        if "//" in key or any(part in (".", "..") for part in key.split("/")):
            raise ConfigError(f"{text!r}: an empty, '.' or '..' part in the object key")
        return cls(match["scheme"], match["bucket"], key)

    def __str__(self) -> str:
        return f"{self.scheme}://{self.bucket}/{self.key}" if self.key else f"{self.scheme}://{self.bucket}"

    def __truediv__(self, part: str) -> ObjectUrl:
        part = str(part).strip("/")
        return ObjectUrl(self.scheme, self.bucket, f"{self.key}/{part}" if self.key else part)

    @property
    def name(self) -> str:
        return self.key.rpartition("/")[2]

    @property
    def store_kind(self) -> str:
        return SCHEMES[self.scheme]


class _Pickled:
    """A store error pickles as its URL and detail (its ``__init__``'s arguments), so it
    crosses a process boundary: the sharder's workers, a cluster engine's tasks."""

    url: str
    detail: str

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return type(self), (self.url, self.detail)


class ObjectMissing(_Pickled, NotFound):
    """The bucket or the object does not exist (404)."""

    def __init__(self, url: ObjectUrl | str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url, self.detail = str(url), detail


class StoreRefused(_Pickled, Unauthenticated):
    """The store refused the credentials, or access to the object (401, 403)."""

    def __init__(self, url: ObjectUrl | str, detail: str) -> None:
        super().__init__(f"{url}: the store refused access ({detail}); check the credentials "
                         "(AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY, ~/.aws/credentials, AWS_PROFILE)")
        self.url, self.detail = str(url), detail


class StoreForbidden(_Pickled, PermissionDenied):
    """The store accepted the credentials but refused access to the object (403)."""

    def __init__(self, url: ObjectUrl | str, detail: str) -> None:
        super().__init__(f"{url}: the store denied access ({detail}); check the bucket's policy for these "
                         "credentials")
        self.url, self.detail = str(url), detail


class StoreUnreachable(_Pickled, ServiceUnavailable):
    """The store could not be reached, or kept failing, for as long as retries last."""

    def __init__(self, url: ObjectUrl | str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url, self.detail = str(url), detail


class ObjectShort(_Pickled, DataError):
    """The object ends before the bytes asked for (416, or a shorter answer)."""

    def __init__(self, url: ObjectUrl | str, detail: str) -> None:
        super().__init__(f"{url}: {detail}")
        self.url, self.detail = str(url), detail


class StoreFault(str, enum.Enum):
    """What a store's failed answer means, carried from the store client to the
    reader and the stream, each with its policy:

    - ``TRANSIENT`` (5xx, throttling, timeouts, connections refused or reset): retried
      for the store's retry window, then the stream ends with UNAVAILABLE;
    - ``UNAUTHORIZED`` (401, refused or expired credentials) and ``FORBIDDEN`` (403):
      the stream ends with UNAUTHENTICATED / PERMISSION_DENIED naming the URL;
    - ``MISSING`` (404) and ``CORRUPT`` (an object shorter than the index says, or
      another permanent answer about it): read again for the heal window
      (:mod:`shards.troubles`), then the bad-sample policy.
    """

    TRANSIENT = "transient"
    UNAUTHORIZED = "unauthorized"
    FORBIDDEN = "forbidden"
    MISSING = "missing"
    CORRUPT = "corrupt"


class Failure(NamedTuple):
    """What a store's error means: its ``kind``, the HTTP ``status`` where there was
    one, and one short line of ``detail``."""

    kind: StoreFault
    status: int | None
    detail: str


_STATUS = re.compile(r"status code: (\d{3})(?: ([A-Za-z ]+))?")
_S3_CODE = re.compile(r"<Code>([A-Za-z]+)</Code>")
_TRANSIENT_TEXT = ("error sending request", "timed out", "timeout", "connection", "reset", "broken pipe",
                   "error decoding response body", "body error", "unexpected eof", "dns error")
_TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# S3 error codes that say the credentials are wrong or have run out, whatever the status
# (400 ExpiredToken, 403 InvalidAccessKeyId, ...): the caller's identity, not the object.
_CREDENTIAL_CODES = {"ExpiredToken", "ExpiredTokenException", "TokenRefreshRequired", "InvalidToken",
                     "InvalidAccessKeyId", "SignatureDoesNotMatch", "RequestExpired", "InvalidClientTokenId"}


def classify(error: BaseException) -> Failure:
    """What an error of the store's client library (obstore) means. Its text is read
    here and nowhere else: an HTTP status where it names one (``Server returned
    non-2xx status code: 404 Not Found: <Error><Code>NoSuchKey</Code>...``), else
    the failure to send (``HTTP error: error sending request``: connection refused,
    reset or timed out). Its exception types agree: ``FileNotFoundError`` for 404,
    ``PermissionDeniedError`` / ``UnauthenticatedError`` for 403 / 401."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    status_match = _STATUS.search(text)
    status = int(status_match[1]) if status_match else None
    code = _S3_CODE.search(text)
    detail = _detail(status_match, code[1] if code else None, first)
    name, s3_code = type(error).__name__, code[1] if code else None
    if status == 404 or isinstance(error, FileNotFoundError):
        return Failure(StoreFault.MISSING, status or 404, detail)
    if status == 401 or s3_code in _CREDENTIAL_CODES or name == "UnauthenticatedError":
        return Failure(StoreFault.UNAUTHORIZED, status, detail)
    if status == 403 or name == "PermissionDeniedError":
        return Failure(StoreFault.FORBIDDEN, status, detail)
    if status in _TRANSIENT_STATUS or s3_code in ("SlowDown", "RequestTimeout"):
        return Failure(StoreFault.TRANSIENT, status, detail)
    if status is None and any(word in text.lower() for word in _TRANSIENT_TEXT):
        return Failure(StoreFault.TRANSIENT, None, detail)
    return Failure(StoreFault.CORRUPT, status, detail)  # 416, or another permanent answer about the object


def _detail(status: re.Match[str] | None, code: str | None, first_line: str) -> str:
    if status is not None:
        words = f"{status[1]} {status[2].strip()}" if status[2] else status[1]
        return f"{words} ({code})" if code else words
    if "error sending request" in first_line:
        return "no answer (connection refused, reset or timed out)"
    return first_line[:200]


def store_error(url: ObjectUrl | str, failure: Failure) -> FeederError:
    """The project's error for a permanent (or given up) ``failure`` on ``url``."""
    kind = failure.kind
    if kind is StoreFault.MISSING:
        return ObjectMissing(url, f"does not exist ({failure.detail})")
    if kind is StoreFault.UNAUTHORIZED:
        return StoreRefused(url, failure.detail)
    if kind is StoreFault.FORBIDDEN:
        return StoreForbidden(url, failure.detail)
    if kind is StoreFault.TRANSIENT:
        return StoreUnreachable(url, f"the store did not answer ({failure.detail})")
    if failure.status == 416:
        return ObjectShort(url, f"shorter than the bytes asked for ({failure.detail})")
    return DataError(f"{url}: the store failed the request ({failure.detail})")
