"""The one table from errors to gRPC status codes and CLI lines."""

from __future__ import annotations

import errno
import pickle
from pathlib import Path

import grpc
import pytest

from core.errors import (
    ConfigError,
    DataError,
    FeederError,
    IdentityMismatch,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    SampleCorrupt,
    ServiceUnavailable,
    Unauthenticated,
    cli_message,
    grpc_code,
    is_cli_message,
    os_error_reason,
)


@pytest.mark.parametrize("error,code,prefix", [
    (ConfigError("x"), grpc.StatusCode.FAILED_PRECONDITION, "error"),
    (InvalidArgument("x"), grpc.StatusCode.INVALID_ARGUMENT, "error"),
    (NotFound("x"), grpc.StatusCode.NOT_FOUND, "not found"),
    (DataError("x"), grpc.StatusCode.DATA_LOSS, "bad data"),
    (ServiceUnavailable("x"), grpc.StatusCode.UNAVAILABLE, "unavailable"),
    (ResourceExhausted("x"), grpc.StatusCode.RESOURCE_EXHAUSTED, "over budget"),
    (Unauthenticated("x"), grpc.StatusCode.UNAUTHENTICATED, "not authenticated"),
    (PermissionDenied("x"), grpc.StatusCode.PERMISSION_DENIED, "permission denied"),
    (IdentityMismatch("x"), grpc.StatusCode.FAILED_PRECONDITION, "error"),
    (FeederError("x"), grpc.StatusCode.INTERNAL, "error"),
])
def test_each_error_has_one_code_and_one_line(error, code, prefix):
    assert grpc_code(error) == code
    assert cli_message(error) == f"feeder: {prefix}: x"
    assert is_cli_message(cli_message(error) + "\n")


@pytest.mark.parametrize("line", ["feeder: serving on 127.0.0.1:5000", "feeder: warning: x",
                                  "2026-01-01 12:00:00,000 INFO feeder.server: feeder: error: x", "error: x"])
def test_other_lines_of_a_command_are_not_its_failure(line):
    assert not is_cli_message(line)


def test_a_corrupt_sample_is_bad_data_and_carries_what_failed():
    error = SampleCorrupt(Path("/d/train/shard-000001.tar"), "00000007_x", 7, half=True)
    assert isinstance(error, DataError) and grpc_code(error) == grpc.StatusCode.DATA_LOSS
    shard = Path("/d/train/shard-000001.tar")
    assert (error.path, error.key, error.index, error.half) == (shard, "00000007_x", 7, True)
    assert cli_message(error).startswith(f"feeder: bad data: {shard}: the half-scale copy of sample 00000007_x ")
    copy = pickle.loads(pickle.dumps(error))  # crosses process boundaries whole
    assert (type(copy), str(copy), copy.index, copy.half) == (SampleCorrupt, str(error), 7, True)


@pytest.mark.parametrize("error,reason", [
    (OSError(errno.ENOSPC, "Error writing bytes to file. Detail: [errno 28] No space left on device"),
     "no space left on device"),
    (OSError(errno.EFBIG, "File too large", "out/a.tar"), "file too large"),
    (OSError("Something odd"), "something odd"),
    (OSError(), "unknown error"),
])
def test_an_os_error_is_told_by_its_errno_whoever_wrapped_it(error: OSError, reason: str) -> None:
    assert os_error_reason(error) == reason
