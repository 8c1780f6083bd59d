"""One root in an object store, as the reader and the sharder use it: ranged and
whole reads, listings, uploads, each request with a timeout and transient failures
retried with exponential backoff and full jitter until a time limit passes.

The client library is obstore (Rust ``object_store``), chosen by measurement
(``bench/s3_clients.py`` against SeaweedFS on this machine, 2 cores shared with the
server; median of 3 runs, 128 MB object, random 50-150 KB ranges)::

                        ranged, 1 at a time   ranged, 8 threads   whole object   CPU s/GB (ranged, whole)
    pyarrow.fs          581-607 reads/s       746-887 reads/s     237-291 MB/s   3.7-4.4, 2.1-2.4
    obstore             673-694 reads/s       965-989 reads/s     359-363 MB/s   2.4-3.0, 1.8-1.9
    s3torchconnector     49-77 reads/s         45-110 reads/s     274-394 MB/s   59-145, 2.4

obstore is 1.1-1.3x pyarrow on ranged reads and 1.25-1.5x on whole objects, for
two thirds of its CPU per byte (which on a small node is taken from decoding);
s3torchconnector's range reader pays a request setup per read. Its own retries are
off (``max_retries`` 0): they are made here, so they are counted and bounded in time.

Credentials and region come the standard way: the environment (``AWS_ACCESS_KEY_ID``,
``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``, ``AWS_ENDPOINT_URL``;
``GOOGLE_APPLICATION_CREDENTIALS``; ``AZURE_STORAGE_*``), else the profile
(``AWS_PROFILE``, default ``default``) of ``~/.aws/credentials`` and ``~/.aws/config``
(or ``AWS_SHARED_CREDENTIALS_FILE`` / ``AWS_CONFIG_FILE``), else instance metadata,
container or web-identity credentials (obstore's own chain).
"""

from __future__ import annotations

import configparser
import os
import random
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, TypeVar

from core.errors import ConfigError
from shards.objects import ObjectShort, ObjectUrl, StoreFault, StoreUnreachable, classify, store_error

__all__ = ["ObjectInfo", "ObjectStore", "StoreCounters", "StoreOptions", "aws_profile", "redacted"]

T = TypeVar("T")
# Uploads larger than this go in parts of _PART_BYTES. Not lower: ranged reads of a
# multipart object are slower on some stores (SeaweedFS here, 57 MB shard, 40 KB
# ranges one at a time: 490-555/s stored in one PUT, 530/s in one 64 MB part, 158-177/s
# in 16 MB parts, 252/s in 5 MB parts), and one PUT takes up to 5 GB.
_MULTIPART_BYTES = 1 << 30
_PART_BYTES = 64 << 20
_UPLOAD_PARTS_IN_FLIGHT = 4


@dataclass(frozen=True)
class StoreOptions:
    """How a store is talked to.

    Args:
        endpoint_url: the S3 API of an S3-compatible store (``http://host:port``);
            None: ``AWS_ENDPOINT_URL``, the profile's ``endpoint_url``, or AWS itself.
        request_timeout_s: the most one request may take, its transfer included.
        connect_timeout_s: the most connecting may take.
        retry_window_s: transient failures (5xx, throttling, timeouts, connections
            refused or reset) are retried until this long after the first one; then
            the request fails as :class:`~shards.objects.StoreUnreachable`.
        first_backoff_s: the first retry waits up to this long; each next one up to
            twice as long (full jitter), at most ``max_backoff_s``.
        max_backoff_s: the longest wait between two tries.
    """

    endpoint_url: str | None = None
    request_timeout_s: float = 30.0
    connect_timeout_s: float = 5.0
    retry_window_s: float = 60.0
    first_backoff_s: float = 0.05
    max_backoff_s: float = 2.0

    def __post_init__(self) -> None:
        for name in ("request_timeout_s", "connect_timeout_s", "first_backoff_s", "max_backoff_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}: must be > 0, got {getattr(self, name)}")
        if not self.retry_window_s >= 0:
            raise ConfigError(f"retry_window_s: must be >= 0, got {self.retry_window_s}")
        if self.endpoint_url is not None and not self.endpoint_url.startswith(("http://", "https://")):
            raise ConfigError(f"s3_endpoint: {redacted(self.endpoint_url)!r} is not an http:// or https:// URL")


class StoreCounters:
    """Requests, retries and bytes of every store of a daemon (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._values = {"requests": 0, "retries": 0, "bytes": 0, "failures": 0}

    def add(self, **amounts: int) -> None:
        with self._lock:
            for name, amount in amounts.items():
                self._values[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._values)


class ObjectInfo(NamedTuple):
    size: int
    etag: str | None


def redacted(url: str) -> str:
    """``url`` with any credentials in it (``http://key:secret@host``) shown as ``***``:
    an endpoint is named in error lines and logs, its secret never."""
    scheme, sep, rest = url.partition("://")
    authority, slash, path = rest.partition("/")
    if "@" not in authority:
        return url
    return f"{scheme}{sep}***@{authority.rpartition('@')[2]}{slash}{path}"


def aws_profile(environ: dict[str, str] | os._Environ[str] = os.environ) -> dict[str, str]:
    """The settings of the AWS profile (``AWS_PROFILE``, else ``default``) from the
    shared credentials and config files: any of ``aws_access_key_id``,
    ``aws_secret_access_key``, ``aws_session_token``, ``region``, ``endpoint_url``.
    Empty where there are no such files."""
    name = environ.get("AWS_PROFILE") or environ.get("AWS_DEFAULT_PROFILE") or "default"
    home = Path(environ.get("HOME", "~")).expanduser()
    found: dict[str, str] = {}
    for path, section in (
        (environ.get("AWS_CONFIG_FILE") or home / ".aws" / "config", name if name == "default" else f"profile {name}"),
        (environ.get("AWS_SHARED_CREDENTIALS_FILE") or home / ".aws" / "credentials", name),
    ):
        parser = configparser.RawConfigParser()
        try:
            parser.read(path, encoding="utf-8")
        except (OSError, configparser.Error) as e:
            raise ConfigError(f"{path}: unreadable AWS settings ({e})") from e
        if parser.has_section(section):
            found.update({k: v.strip() for k, v in parser.items(section) if v.strip()})
    return found


def _s3_settings(options: StoreOptions) -> dict[str, Any]:
    """Keyword arguments of obstore's S3Store beside the environment it reads itself."""
    env = os.environ
    profile = aws_profile(env)
    settings: dict[str, Any] = {}
    if "AWS_ACCESS_KEY_ID" not in env and "aws_access_key_id" in profile:
        settings["access_key_id"] = profile["aws_access_key_id"]
        settings["secret_access_key"] = profile.get("aws_secret_access_key", "")
        if "aws_session_token" in profile:
            settings["token"] = profile["aws_session_token"]
    region = env.get("AWS_REGION") or env.get("AWS_DEFAULT_REGION") or profile.get("region")
    settings["region"] = region or "us-east-1"
    endpoint = options.endpoint_url or env.get("AWS_ENDPOINT_URL_S3") or env.get("AWS_ENDPOINT_URL") \
        or profile.get("endpoint_url")
    if endpoint:
        # An S3-compatible store: path-style requests (http://host/bucket/key).
        settings.update(endpoint=endpoint, virtual_hosted_style_request=False)
    return settings


def _client_options(options: StoreOptions) -> dict[str, Any]:
    endpoint = options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or ""
    return {"timeout": f"{int(options.request_timeout_s * 1000)}ms",
            "connect_timeout": f"{int(options.connect_timeout_s * 1000)}ms",
            "allow_http": endpoint.startswith("http://")}


def _open_store(root: ObjectUrl, options: StoreOptions) -> Any:
    from obstore import store as stores  # loads the Rust client only where a remote root is used

    common: dict[str, Any] = {"prefix": root.key or None, "client_options": _client_options(options),
                              "retry_config": {"max_retries": 0}}
    try:
        if root.store_kind == "s3":
            return stores.S3Store(root.bucket, **common, **_s3_settings(options))
        if root.store_kind == "gcs":
            return stores.GCSStore(root.bucket, **common)
        return stores.AzureStore(root.bucket, **common)
    except Exception as e:  # obstore raises its configuration errors as several types
        raise ConfigError(f"{root}: cannot set up the store client ({str(e).splitlines()[0]})") from e


class ObjectStore:
    """The objects under ``root``, named relative to it (``train/shard-000000.tar``).
    Thread-safe.

    Args:
        root: the URL of the prefix (a shard directory).
        options: timeouts, endpoint and retries.
        counters: where requests, retries and bytes are counted (shared by a daemon's stores).
        stopping: set when the daemon stops: waits between retries end at once and
            the request fails as unreachable (shared by a daemon's stores).
    """

    def __init__(self, root: ObjectUrl, options: StoreOptions = StoreOptions(),
                 counters: StoreCounters | None = None, stopping: threading.Event | None = None) -> None:
        self.root, self.options = root, options
        self.counters = counters or StoreCounters()
        self.stopping = stopping or threading.Event()
        self._store = _open_store(root, options)

    def url(self, name: str) -> ObjectUrl:
        return self.root / name if name else self.root

    def _call(self, name: str, request: Callable[[], T], window_s: float | None = None) -> T:
        """``request()``, retried on transient failures for ``window_s`` (the
        options' ``retry_window_s`` by default).

        Raises:
            ObjectMissing, StoreRefused, ObjectShort, DataError: a permanent failure.
            StoreUnreachable: transient failures for longer than the window.
        """
        window_s = self.options.retry_window_s if window_s is None else window_s
        first, attempt = time.monotonic(), 0
        while True:
            self.counters.add(requests=1)
            try:
                return request()
            except Exception as e:  # obstore's errors have no common base; classify reads them all
                failure = classify(e)
                if failure.kind is not StoreFault.TRANSIENT:
                    self.counters.add(failures=1)
                    raise store_error(self.url(name), failure) from e
                wait_s = random.uniform(0, min(self.options.max_backoff_s, self.options.first_backoff_s * 2 ** attempt))
                if time.monotonic() + wait_s - first > window_s:
                    self.counters.add(failures=1)
                    raise StoreUnreachable(self.url(name), f"the store did not answer for "
                                           f"{time.monotonic() - first:.1f} s ({failure.detail}; "
                                           f"endpoint {self.endpoint})") from e
            self.counters.add(retries=1)
            attempt += 1
            if self.stopping.wait(wait_s):
                raise StoreUnreachable(self.url(name), "the daemon is stopping")

    @property
    def endpoint(self) -> str:
        given = self.options.endpoint_url or os.environ.get("AWS_ENDPOINT_URL")
        return redacted(given) if given else f"the {self.root.store_kind} default"

    def head(self, name: str, window_s: float | None = None) -> ObjectInfo:
        """Size and ETag of object ``name``."""
        import obstore

        meta = self._call(name, lambda: obstore.head(self._store, name), window_s)
        return ObjectInfo(int(meta["size"]), meta.get("e_tag"))

    def listing(self, prefix: str = "", window_s: float | None = None) -> dict[str, ObjectInfo]:
        """Every object under ``prefix`` (a "directory" relative to the root; "" for
        all), by name relative to the root. An absent bucket is ObjectMissing."""
        import obstore

        def listed() -> dict[str, ObjectInfo]:
            found = {}
            for chunk in obstore.list(self._store, prefix=prefix or None, chunk_size=1000):
                for meta in chunk:
                    found[str(meta["path"])] = ObjectInfo(int(meta["size"]), meta.get("e_tag"))
            return found

        return self._call(prefix, listed, window_s)

    def list_directory(
        self, directory: str = "", window_s: float | None = None
    ) -> tuple[dict[str, ObjectInfo], set[str]]:
        """(objects, sub-directories) directly under ``directory`` ("" for the root),
        by name relative to the root. An absent bucket is ObjectMissing."""
        import obstore

        prefix = f"{directory}/" if directory else None
        listed = self._call(directory, lambda: obstore.list_with_delimiter(self._store, prefix=prefix), window_s)
        objects = {str(m["path"]): ObjectInfo(int(m["size"]), m.get("e_tag")) for m in listed["objects"]}
        return objects, {str(p).rstrip("/") for p in listed["common_prefixes"]}

    def get_range(self, name: str, start: int, length: int, exact: bool = True) -> memoryview:
        """Bytes ``start .. start + length`` of object ``name``.

        Raises:
            ObjectShort: the object ends before them (with ``exact=False``, only when
                it ends before ``start``: fewer bytes come back).
            ObjectMissing, StoreRefused, StoreUnreachable, DataError: see ``_call``.
        """
        import obstore

        data = memoryview(self._call(name, lambda: obstore.get_range(self._store, name, start=start, length=length)))
        self.counters.add(bytes=len(data))
        if len(data) != length and exact:
            raise ObjectShort(self.url(name), f"{len(data)} bytes at offset {start}, {length} asked for "
                              "(shorter than the index says)")
        return data

    def read_bytes(self, name: str, window_s: float | None = None) -> bytes:
        """The whole of a small object (a manifest, an index)."""
        import obstore

        data = self._call(name, lambda: bytes(obstore.get(self._store, name).bytes()), window_s)
        self.counters.add(bytes=len(data))
        return data

    def chunks(self, name: str, size: int, chunk_bytes: int = 16 << 20) -> Iterator[memoryview]:
        """Object ``name`` of ``size`` bytes in consecutive ranges of ``chunk_bytes``
        (each its own request, retried on its own: a reset costs one chunk)."""
        for start in range(0, size, chunk_bytes):
            yield self.get_range(name, start, min(chunk_bytes, size - start))

    def put_file(self, name: str, path: Path) -> None:
        """Upload the file at ``path`` as object ``name``: in one request, or in parts
        of 64 MiB above 1 GiB. The object appears whole or not at all."""
        import obstore

        size = path.stat().st_size

        def upload() -> None:
            obstore.put(self._store, name, path, use_multipart=size > _MULTIPART_BYTES, chunk_size=_PART_BYTES,
                        max_concurrency=_UPLOAD_PARTS_IN_FLIGHT)

        self._call(name, upload)
        self.counters.add(bytes=size)

    def put_bytes(self, name: str, data: bytes) -> None:
        import obstore

        self._call(name, lambda: obstore.put(self._store, name, data, use_multipart=False))
        self.counters.add(bytes=len(data))

    def delete(self, names: list[str]) -> None:
        import obstore

        for start in range(0, len(names), 1000):  # S3 deletes at most 1,000 keys a request
            part = names[start:start + 1000]
            self._call(part[0], lambda: obstore.delete(self._store, part))
