"""Object store URLs, and what each shape of the store client's errors means (the
texts are the client's own, as it raised them against the test server)."""

from __future__ import annotations

from pathlib import Path

import pytest

from core.errors import ConfigError, DataError, NotFound, PermissionDenied, ServiceUnavailable, Unauthenticated
from shards.objects import ObjectUrl, StoreFault, classify, is_remote, local_path, store_error
from shards.store import ObjectStore, StoreOptions, redacted


def test_urls_parse_print_and_join() -> None:
    url = ObjectUrl.parse("s3://bucket/a/b/")
    assert (url.bucket, url.key, str(url)) == ("bucket", "a/b", "s3://bucket/a/b")
    assert str(url / "train/shard-000000.tar") == "s3://bucket/a/b/train/shard-000000.tar"
    assert (url / "train/shard-000000.tar").name == "shard-000000.tar"
    assert str(ObjectUrl.parse("gs://b")) == "gs://b" and ObjectUrl.parse("az://c/x").store_kind == "azure"


@pytest.mark.parametrize("text", ["http://host/x", "s3:/bucket", "/data/shards", "s3://bucket/a//b", "s3://b/../x"])
def test_what_is_not_a_store_url_is_refused_naming_it(text: str) -> None:
    with pytest.raises(ConfigError, match="s3://|key"):
        ObjectUrl.parse(text)


def test_remote_and_local_roots_are_told_apart() -> None:
    assert is_remote("s3://b/p") and is_remote("gs://b") and not is_remote("/data") and not is_remote(Path("s3:/b"))
    assert local_path("file:///data/shards") == Path("/data/shards")
    assert local_path("~/x") == Path("~/x").expanduser()


class PermissionDeniedError(Exception):
    """Named as the client library's own (its exceptions are told apart by name)."""


_NOT_FOUND = ("Object at location p/nope not found: Error performing GET http://127.0.0.1:39493/bkt/p/nope in "
              "754.056µs - Server returned non-2xx status code: 404 Not Found: <?xml version=\"1.0\" encoding="
              "\"UTF-8\"?>\n<Error><Code>NoSuchKey</Code><Message>The specified key does not exist.</Message>")
_NO_BUCKET = ("Object at location p/a.bin not found: Error performing GET http://127.0.0.1:39493/nobucket/p/a.bin "
              "in 1.358364ms - Server returned non-2xx status code: 404 Not Found: <Error><Code>NoSuchBucket</Code>")
_DENIED = ("The operation lacked the necessary privileges to complete for path p/a.bin: Error performing GET "
           "http://127.0.0.1:39493/bkt/p/a.bin in 661.634µs - Server returned non-2xx status code: 403 Forbidden: "
           "<Error><Code>SignatureDoesNotMatch</Code>")
_RANGE = ("Generic S3 error: Error performing GET http://127.0.0.1:39493/bkt/p/a.bin in 754.747µs - Server returned "
          "non-2xx status code: 416 Range Not Satisfiable: <Error><Code>InvalidRange</Code>")
_REFUSED = ("Generic S3 error: Error performing GET http://127.0.0.1:1/bkt/p/a.bin in 117.469µs - HTTP error: error "
            "sending request\n\nDebug source:\nGeneric {\n    store: \"S3\",")
# The store killed while it sent a body (seen from SeaweedFS under SIGKILL).
_CUT = "Generic S3 error: HTTP error: request or response body error"
_SLOW_DOWN = ("Generic S3 error: Error performing GET http://h/b/k in 2ms - Server returned non-2xx status code: "
              "503 Service Unavailable: <Error><Code>SlowDown</Code><Message>Please reduce your request rate.")
_THROTTLED = "Generic S3 error: Server returned non-2xx status code: 429 Too Many Requests: "
_BAD_REQUEST = ("Generic S3 error: Server returned non-2xx status code: 400 Bad Request: "
                "<Error><Code>InvalidArgument</Code>")
# A session token past its expiry (AWS answers 400, not 401).
_EXPIRED = ("Generic S3 error: Error performing GET https://b.s3.amazonaws.com/p/a.bin in 40ms - Server returned "
            "non-2xx status code: 400 Bad Request: <Error><Code>ExpiredToken</Code><Message>The provided token has "
            "expired.</Message>")
_ACCESS_DENIED = ("The operation lacked the necessary privileges to complete for path p/a.bin: Error performing GET "
                  "http://h/b/p/a.bin in 1ms - Server returned non-2xx status code: 403 Forbidden: "
                  "<Error><Code>AccessDenied</Code>")


@pytest.mark.parametrize("error, kind, status, detail", [
    (FileNotFoundError(_NOT_FOUND), StoreFault.MISSING, 404, "404 Not Found (NoSuchKey)"),
    (FileNotFoundError(_NO_BUCKET), StoreFault.MISSING, 404, "404 Not Found (NoSuchBucket)"),
    (PermissionDeniedError(_DENIED), StoreFault.UNAUTHORIZED, 403, "403 Forbidden (SignatureDoesNotMatch)"),
    (PermissionDeniedError(_ACCESS_DENIED), StoreFault.FORBIDDEN, 403, "403 Forbidden (AccessDenied)"),
    (RuntimeError(_EXPIRED), StoreFault.UNAUTHORIZED, 400, "400 Bad Request (ExpiredToken)"),
    (RuntimeError(_RANGE), StoreFault.CORRUPT, 416, "416 Range Not Satisfiable (InvalidRange)"),
    (RuntimeError(_REFUSED), StoreFault.TRANSIENT, None, "no answer (connection refused, reset or timed out)"),
    (RuntimeError(_CUT), StoreFault.TRANSIENT, None, _CUT),
    (RuntimeError(_SLOW_DOWN), StoreFault.TRANSIENT, 503, "503 Service Unavailable (SlowDown)"),
    (RuntimeError(_THROTTLED), StoreFault.TRANSIENT, 429, "429 Too Many Requests"),
    (RuntimeError(_BAD_REQUEST), StoreFault.CORRUPT, 400, "400 Bad Request (InvalidArgument)"),
])
def test_each_shape_of_store_error_is_classified(error: Exception, kind: StoreFault, status: int | None,
                                                 detail: str) -> None:
    assert tuple(classify(error)) == (kind, status, detail)


@pytest.mark.parametrize("error, expected", [
    (FileNotFoundError(_NOT_FOUND), NotFound),
    (PermissionDeniedError(_DENIED), Unauthenticated),
    (RuntimeError(_EXPIRED), Unauthenticated),
    (PermissionDeniedError(_ACCESS_DENIED), PermissionDenied),
    (RuntimeError(_RANGE), DataError),
    (RuntimeError(_REFUSED), ServiceUnavailable),
    (RuntimeError(_BAD_REQUEST), DataError),
])
def test_store_errors_become_the_projects_own_naming_the_url(error: Exception, expected: type) -> None:
    found = store_error("s3://bkt/p/a.bin", classify(error))
    assert isinstance(found, expected)
    assert str(found).startswith("s3://bkt/p/a.bin: ")


def test_credentials_in_an_endpoint_never_reach_a_message(monkeypatch: pytest.MonkeyPatch) -> None:
    # Before: an --s3-endpoint of http://key:secret@host was echoed whole in error lines.
    assert redacted("http://key:s3cret@127.0.0.1:9000/x") == "http://***@127.0.0.1:9000/x"
    assert redacted("https://h:9000") == "https://h:9000"
    with pytest.raises(ConfigError) as caught:
        StoreOptions(endpoint_url="ftp://key:s3cret@h")
    assert "s3cret" not in str(caught.value) and "***@h" in str(caught.value)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    store = ObjectStore(ObjectUrl.parse("s3://b/p"), StoreOptions(endpoint_url="http://key:s3cret@127.0.0.1:1",
                                                                   retry_window_s=0))
    with pytest.raises(ServiceUnavailable) as unreachable:
        store.head("x")
    assert "s3cret" not in str(unreachable.value) and "http://***@127.0.0.1:1" in str(unreachable.value)
